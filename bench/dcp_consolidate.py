"""torch's own DCP consolidation routes, as benchmark contenders (a child process each).

    python bench/dcp_consolidate.py hf HF_DIR OUT_DIR       # sharded safetensors -> one file
    python bench/dcp_consolidate.py distcp DCP_DIR OUT.pt   # native .distcp -> torch.save

``hf``: ``torch.distributed.checkpoint._consolidate_hf_safetensors.consolidate_safetensors_files``
(torch 2.13: ``(input_dir, output_dir, fqn_to_index_mapping, num_threads=1)``; the mapping is
required despite its doc, so every tensor the shards name goes to file 1, as streamck writes
one file). ``distcp``: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``.
Then every file written is fsynced, as streamck and the ``cp -r`` + ``sync`` baseline do.
"""

import json
import os
import struct
import sys
from pathlib import Path

mode, src, out = sys.argv[1:4]
if mode == "hf":
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    names = set()
    for shard in sorted(Path(src).glob("*.safetensors")):
        with open(shard, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            names.update(k for k in json.loads(f.read(n)) if k != "__metadata__")
    Path(out).mkdir(parents=True)
    consolidate_safetensors_files(src, out, dict.fromkeys(sorted(names), 1))
elif mode == "distcp":
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(src, out)
else:
    sys.exit(f"unknown mode {mode!r}")

for path in [Path(out)] if Path(out).is_file() else sorted(Path(out).iterdir()):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
