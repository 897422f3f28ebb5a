"""What a transform is: an output tensor's bytes computed from source tensors, block by block.

The plan attaches a transform to an output tensor (``OutputTensor.transform``); the writer asks
it for the bytes in bounded pieces and writes them; ``--verify`` asks again and compares. A
transform reads its inputs through the writer's ``Reader`` (kernel-side reads into its own
buffers), never holds a whole tensor that can be cut, and imports torch only inside an engine
that needs it. Casts are the one transform without an object: an output whose dtype differs
from its source's and has no transform is cast (streamck.transforms.cast).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from streamck.source.header import TensorRef
from streamck.source.reader import Reader


class Target(Protocol):
    """The output tensor a transform computes (streamck.plan.OutputTensor is one)."""

    @property
    def name(self) -> str: ...
    @property
    def source(self) -> TensorRef: ...
    @property
    def dtype(self) -> str: ...


class Transform(Protocol):
    """How one output tensor's bytes are computed.

    ``label`` is what a dry run shows beside the output dtype (``+LoRA``; empty for none);
    ``engine`` names the arithmetic (``torch``, ``numpy``); ``exact`` says whether that engine
    gives its oracle's bits (PEFT's, llm-compressor's), and so whether ``--verify`` may expect
    byte-equal output from a recomputation (it always does: the pieces are deterministic).
    """

    @property
    def label(self) -> str: ...
    @property
    def engine(self) -> str: ...
    @property
    def exact(self) -> bool: ...

    def inputs(self) -> tuple[TensorRef, ...]:
        """The source tensors read besides the output's own source."""
        ...

    def origin(self, source: TensorRef) -> TensorRef:
        """The tensor a listing names as the output's source (``source`` unless the bytes come
        from elsewhere, as a saved adapter copy's do)."""
        ...

    def pieces(self, target: Target, reader: Reader, space: dict) -> Iterator[memoryview]:
        """``target``'s bytes in bounded pieces, each valid until the next, the same bits on
        every call. ``space`` is the caller's dict (one per writer thread) for buffers kept
        from one tensor to the next."""
        ...
