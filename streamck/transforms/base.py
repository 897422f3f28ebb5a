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
from dataclasses import dataclass
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
        from one tensor to the next; its ``"device"`` (DEVICE) is where a torch engine
        computes (``--device``: ``cpu``, ``cuda`` or ``cuda:N``; absent: the CPU)."""
        ...


class OwnSource:
    """The usual ``inputs`` and ``origin`` of a Transform: nothing read besides the output's own
    source, which a listing names (a base for the frozen dataclasses that implement one)."""

    __slots__ = ()

    def inputs(self) -> tuple[TensorRef, ...]:
        return ()

    def origin(self, source: TensorRef) -> TensorRef:
        return source


DEVICE = "device"  # the key of ``space`` naming the device a torch engine computes on


def device_of(space: dict) -> str:
    """Where a torch engine computes, by the writer's ``space`` (the CPU unless it names one)."""
    return space.get(DEVICE) or "cpu"


@dataclass(frozen=True, slots=True)
class Computed:
    """The output a transform computes, for a transform that reads it as its input (a LoRA
    merge quantized in the same pass): the name, the source and the dtype it is computed in."""

    name: str
    source: TensorRef
    dtype: str


class PieceStream:
    """``readinto`` over a transform's pieces, so that a second transform reads computed bytes
    in its own blocks as it would read a source's (streamck.source.reader.TensorStream)."""

    def __init__(self, pieces: Iterator[memoryview]):
        self._pieces, self._left = pieces, memoryview(b"")

    def readinto(self, view: memoryview) -> int:
        done = 0
        while done < len(view):
            if not self._left:
                nxt = next(self._pieces, None)
                if nxt is None:
                    break
                self._left = memoryview(nxt).cast("B")
            n = min(len(self._left), len(view) - done)
            view[done : done + n] = self._left[:n]
            self._left, done = self._left[n:], done + n
        return done
