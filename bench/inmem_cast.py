"""The compute ceiling of a cast: F32 -> BF16 of BYTES bytes already in memory, by the
numpy converter streamck's CPU caster uses, 4 MiB steps into a preallocated output.
Prints the seconds the conversion took (allocation excluded).

    python bench/inmem_cast.py BYTES
"""

import sys
import time

import numpy as np

from streamck.transforms.npcast import Converter

n = int(sys.argv[1]) // 4
src = np.random.default_rng(0).standard_normal(n, dtype=np.float32).view(np.uint8)
dst = np.ones(n * 2, np.uint8)  # every page touched before timing (np.zeros maps them lazily)
conv, step = Converter(), 4 << 20
scratch = np.empty(step, np.uint8)  # convert may overwrite its input: a copy per step, as a read would fill
t0 = time.perf_counter()
for i in range(0, len(src), step):
    k = min(step, len(src) - i)
    np.copyto(scratch[:k], src[i : i + k])
    conv.convert("F32", "BF16", scratch[:k], dst[i // 2 : (i + k) // 2])
print(time.perf_counter() - t0)
