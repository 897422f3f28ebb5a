"""The route streamck replaces: load every shard whole, edit in memory, save, fsync.

python bench/naive.py SRC_DIR OUT_DIR [--dtype bf16]
"""

import os
import sys
from pathlib import Path

src, out = Path(sys.argv[1]), Path(sys.argv[2])
cast = "--dtype" in sys.argv
out.mkdir(parents=True)
for shard in sorted(src.glob("*.safetensors")):
    if cast:
        import torch
        from safetensors.torch import load_file, save_file

        tensors = {k.removeprefix("model."): v.to(torch.bfloat16) for k, v in load_file(shard).items()}
    else:
        from safetensors.numpy import load_file, save_file

        tensors = {k.removeprefix("model."): v for k, v in load_file(shard).items()}
    save_file(tensors, str(out / shard.name), metadata={"format": "pt"})
    del tensors
    fd = os.open(out / shard.name, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
