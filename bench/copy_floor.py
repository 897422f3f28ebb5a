"""The floor of a per-tensor Python copy: the least any Python tool does to copy a sharded
safetensors folder with every name rewritten (``--strip-prefix``), for the count case's table.

Per shard: read its header (orjson), rename every entry, encode the header again, write it,
copy the data section with ``copy_file_range`` and fsync; then the index, renamed the same
way. No checks, no plan, no index of runs, no atomic rename: what is left is the interpreter's
start-up, the JSON, and one dict entry per tensor. argv: SRC OUT PREFIX.
"""

import os
import struct
import sys
from pathlib import Path

import orjson


def copy_shard(src: Path, dst: Path, prefix: str) -> None:
    with open(src, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = orjson.loads(f.read(n))
        size = os.fstat(f.fileno()).st_size
        renamed = {(k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in header.items()}
        raw = orjson.dumps(renamed)
        raw += b" " * (-len(raw) % 8)
        with open(dst, "wb") as out:
            out.write(struct.pack("<Q", len(raw)) + raw)
            out.flush()
            at, left = 8 + n, size - 8 - n
            while left:
                done = os.copy_file_range(f.fileno(), out.fileno(), left, at)
                at, left = at + done, left - done
            os.fsync(out.fileno())


def main(src: Path, out: Path, prefix: str) -> None:
    out.mkdir()
    for shard in sorted(src.glob("*.safetensors")):
        copy_shard(shard, out / shard.name, prefix)
    index = orjson.loads((src / "model.safetensors.index.json").read_bytes())
    index["weight_map"] = {(k[len(prefix) :] if k.startswith(prefix) else k): v for k, v in index["weight_map"].items()}
    (out / "model.safetensors.index.json").write_bytes(orjson.dumps(index))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
