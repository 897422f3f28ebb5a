"""The caster a run uses, by device: numpy on the CPU (cast), torch on CUDA (cudacast)."""

from __future__ import annotations

from streamck.errors import UsageError
from streamck.transforms.cast import CAST_CHUNK, Caster
from streamck.transforms.cudacast import CudaCaster


def make_caster(device: str, chunk: int = CAST_CHUNK) -> Caster | CudaCaster:
    """A caster for ``device`` (``cpu``, ``cuda`` or ``cuda:N``) with steps of at most ``chunk``
    bytes; the CUDA one imports torch and checks the device now, so a run fails before any
    file exists. Raises UsageError for another device, DeviceError for an unusable one."""
    chunk = min(chunk, CAST_CHUNK)
    if device == "cpu":
        return Caster(chunk)
    if device.split(":")[0] == "cuda":
        return CudaCaster(chunk, device)
    raise UsageError(f"{{device}} {device}: only cpu and cuda are supported")
