"""The route streamck replaces for .bin checkpoints: torch.load the whole state dict, save_file, fsync.

python bench/naive_bin.py SRC.bin OUT.safetensors
"""

import os
import sys

import torch
from safetensors.torch import save_file

state = torch.load(sys.argv[1], weights_only=True, mmap=False)
save_file({k: v.contiguous() for k, v in state.items()}, sys.argv[2], metadata={"format": "pt"})
fd = os.open(sys.argv[2], os.O_RDONLY)
os.fsync(fd)
os.close(fd)
