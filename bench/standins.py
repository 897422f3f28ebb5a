"""Stand-ins for GPU-only modules the trainers import at module level but never run on CPU.

torchtitan's expert-parallel kernels and megatron-core's MoE stash import ``triton`` when
their packages load; nothing the fixtures run calls them. ``without_triton`` lets such an
import succeed and removes the stand-in afterwards, so torch's compiler (FlexAttention)
keeps seeing no triton.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager


class _Any:
    """Whatever a Triton kernel module asks of ``triton`` at import time."""

    def __getattr__(self, name: str) -> _Any:
        return _Any()

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Any()

    def __getitem__(self, key) -> _Any:
        return _Any()


class _Module(types.ModuleType):
    __version__ = "3.4.0"  # megatron-core compares it at import

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()


NAMES = ("triton", "triton.language")


@contextmanager
def without_triton() -> Iterator[None]:
    """Imports inside see a stand-in ``triton``; torch's own probes ran before and found none."""
    # torch's own triton probes run first, and find none
    import torch._dynamo
    import torch._inductor.compile_fx
    import torch._inductor.ir
    import torch._inductor.runtime.triton_compat  # noqa: F401
    from torch.utils._triton import has_triton_package

    has_triton_package()
    for name in NAMES:
        sys.modules[name] = _Module(name)
    sys.modules["triton"].language = sys.modules["triton.language"]
    try:
        yield
    finally:
        for name in NAMES:
            sys.modules.pop(name, None)
