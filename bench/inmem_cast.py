"""The compute ceiling of a cast: F32 -> BF16 of BYTES bytes already in memory, torch copy_
into a preallocated tensor. Prints the seconds the copy_ took (allocation excluded).

    python bench/inmem_cast.py BYTES
"""

import sys
import time

import torch

n = int(sys.argv[1]) // 4
src = torch.randn(n, dtype=torch.float32)
dst = torch.empty(n, dtype=torch.bfloat16)
dst.zero_()  # touch every page before timing
t0 = time.perf_counter()
dst.copy_(src)
print(time.perf_counter() - t0)
