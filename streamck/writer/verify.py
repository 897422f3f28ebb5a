"""``--verify``: re-read what was written and check it against the source before it is kept."""

from __future__ import annotations

import os
from pathlib import Path

from streamck.errors import OutputError
from streamck.source import TensorRef
from streamck.source.reader import ChunkReader
from streamck.writer.layout import Shard


def _nan_only(a: memoryview, b: memoryview, dtype: str) -> bool:
    # A cast's NaN payload may legitimately differ (torch's vector and scalar loops
    # disagree, and so do CPU and CUDA); any other difference is a real one.
    import torch

    from streamck.writer.cast import torch_dtype

    x = torch.frombuffer(bytearray(a), dtype=torch_dtype(dtype))
    y = torch.frombuffer(bytearray(b), dtype=torch_dtype(dtype))
    same = (x.view(torch.uint8) == y.view(torch.uint8)).view(-1, x.element_size()).all(1)
    return bool((same | (torch.isnan(x) & torch.isnan(y))).all())


def verify_shard(shard: Shard, path: Path, caster_factory) -> None:
    """Check every tensor of the written ``shard`` at ``path`` against its source: equal
    bytes, or for a cast equal to a fresh cast of the source. Raises OutputError."""
    offset = len(shard.header)
    with ChunkReader() as out_reader, ChunkReader() as src_reader:
        for t in shard.tensors:
            written = TensorRef(t.name, t.dtype, t.shape, path, offset, offset + t.nbytes)
            offset += t.nbytes
            if not t.is_cast:
                pairs = zip(out_reader.chunks(written), src_reader.chunks(t.source), strict=True)
                if any(a != b for a, b in pairs):
                    raise OutputError(f"verification failed: {t.name} differs from its source", path)
                continue
            src = t.source
            fd = os.open(src.path, os.O_RDONLY)
            try:
                pos = written.start
                for expected, _ in caster_factory().convert(
                    fd, src.start, src.numel, src.dtype, t.dtype, str(src.path)
                ):
                    got = next(out_reader.chunks(written._replace(start=pos, end=pos + len(expected))))
                    if got != expected and not _nan_only(got, expected, t.dtype):
                        raise OutputError(
                            f"verification failed: {t.name} differs from a fresh cast of its source", path
                        )
                    pos += len(expected)
            finally:
                os.close(fd)
