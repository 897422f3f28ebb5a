"""``--verify``: re-read what was written and check it against the source before it is kept."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

from streamck.errors import OutputError
from streamck.fileio import read_into
from streamck.plan import OutputTensor
from streamck.source.reader import Reader
from streamck.writer.layout import Shard
from streamck.writer.progress import Silent

_SILENT = Silent()


def _nan_only(a: memoryview, b: memoryview, dtype: str) -> bool:
    # A cast's NaN payload may legitimately differ (torch's vector and scalar loops
    # disagree, and so do CPU and CUDA); any other difference is a real one.
    from streamck.transforms.npcast import equal_but_nan_bits

    return equal_but_nan_bits(a, b, dtype)


def _expected(t: OutputTensor, reader: Reader, caster_factory: Callable) -> Iterator[memoryview]:
    """What ``t`` should hold, in bounded pieces: its source's bytes, a fresh CPU cast, or
    its transform computed again (deterministic: the same blocks in the same order)."""
    if t.transform is not None:
        yield from t.transform.pieces(t, reader, {})
        return
    if not t.is_cast:
        yield from reader.windows(t.source)
        return
    for view, _ in caster_factory().convert(reader.stream(t.source), t.dtype):
        yield view


def _verify_archive(shard: Shard, path: Path, fd: int, caster_factory: Callable) -> None:
    """A torch.save archive against the archive streamed afresh from the sources: the same
    bytes, CRCs and all (its casts run on the CPU, so a fresh cast gives the same bits)."""
    from streamck.writer.torchsave import stream_archive

    current = [""]

    def expected(t: OutputTensor, reader: Reader) -> Iterator[memoryview]:
        current[0] = t.name
        yield from _expected(t, reader, caster_factory)

    offset, buffer = 0, bytearray()
    with Reader() as reader:
        for piece in stream_archive(shard.filename, shard.entries, (expected(t, reader) for t in shard.tensors)):
            if len(buffer) < len(piece):
                buffer = bytearray(len(piece))
            got = memoryview(buffer)[: len(piece)]
            read_into(fd, got, offset, str(path))
            offset += len(piece)
            if got != piece:
                what = f"{current[0]} or its record" if current[0] else "the archive's records"
                raise OutputError(f"verification failed: {what} differs from its source", path)


def verify_shard(shard: Shard, path: Path, caster_factory: Callable, progress: Silent = _SILENT) -> None:
    """Check the written ``shard`` at ``path``: its size, its header byte for byte, and every
    tensor against its source: equal bytes, or for a cast equal to a fresh cast of the
    source. Each tensor and its bytes checked are told to ``progress``. Raises OutputError."""
    offset, buffer = len(shard.header), bytearray(len(shard.header))
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != shard.size:
            raise OutputError(f"verification failed: file is {size} bytes, its layout says {shard.size}", path)
        if shard.format == "torch":
            _verify_archive(shard, path, fd, caster_factory)
            return
        read_into(fd, memoryview(buffer), 0, str(path))
        if buffer != shard.header:
            raise OutputError("verification failed: the header differs from the plan's", path)
        with Reader() as reader:
            for t in shard.tensors:
                progress.tensor(t.name)
                for expected in _expected(t, reader, caster_factory):
                    if len(buffer) < len(expected):
                        buffer = bytearray(len(expected))
                    got = memoryview(buffer)[: len(expected)]
                    read_into(fd, got, offset, str(path))
                    offset += len(expected)
                    progress(len(expected))
                    if got == expected or (t.is_cast and _nan_only(got, expected, t.dtype)):
                        continue
                    what = "a fresh cast of its source" if t.is_cast else "its source"
                    raise OutputError(f"verification failed: {t.name} differs from {what}", path)
    finally:
        os.close(fd)
