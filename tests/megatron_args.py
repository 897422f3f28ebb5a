"""A Megatron step's saved ``args`` changed in place: what a run with other flags would have recorded."""

from __future__ import annotations

from pathlib import Path

import torch


def with_args(run: Path, keep_config: bool = False, **changes) -> Path:
    """``run``'s iteration with its common_state item rewritten: the args megatron-core saved
    (their plain values, as streamck reads them) with ``changes``, pickled as a Namespace
    again and appended to the data file, the DCP metadata pointed at the new bytes (a run's
    config.json removed unless ``keep_config``)."""
    import argparse
    import io
    import pickle

    from streamck.plan.megatron.args import read_args
    from streamck.plan.megatron.plan import step_dir

    step = step_dir(run)
    args, iteration = read_args(step)
    buffer = io.BytesIO()
    torch.save({"args": argparse.Namespace(**{**args, **changes}), "iteration": iteration}, buffer)
    meta = pickle.loads((step / ".metadata").read_bytes())
    index = next(k for k in meta.storage_data if k.fqn.startswith("common_state/"))
    info = meta.storage_data[index]
    data = step / info.relative_path
    offset = data.stat().st_size
    with data.open("ab") as f:
        f.write(buffer.getvalue())
    meta.storage_data[index] = type(info)(info.relative_path, offset, len(buffer.getvalue()))
    (step / ".metadata").write_bytes(pickle.dumps(meta))
    if not keep_config:
        (run / "config.json").unlink(missing_ok=True)  # the sizes from the args alone
    return run
