"""An XFS filesystem with reflink on a loop device, for the clone test and benchmark.

Mounting needs root and ``mkfs.xfs`` (xfsprogs, installed by scripts/test when it runs
as root); ``reflink_mount`` raises ``Unavailable`` saying which is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class Unavailable(Exception):
    """No reflink XFS can be mounted here; the message says why."""


@contextmanager
def reflink_mount(directory: Path, size: int) -> Iterator[Path]:
    """Make a sparse ``size``-byte image in ``directory``, format it XFS with reflink
    (``mkfs.xfs -m reflink=1``), mount it on a loop device and yield the mount point;
    unmounted (and the loop device released) on exit."""
    if os.geteuid() != 0:
        raise Unavailable("mounting a loop device needs root")
    mkfs = shutil.which("mkfs.xfs", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
    if mkfs is None:
        raise Unavailable("mkfs.xfs not found (apt-get install xfsprogs)")
    image, mnt = directory / "xfs.img", directory / "mnt"
    with open(image, "wb") as f:
        f.truncate(size)
    mnt.mkdir()
    for cmd in ([mkfs, "-q", "-f", "-m", "reflink=1", str(image)], ["mount", "-o", "loop", str(image), str(mnt)]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise Unavailable(f"{' '.join(cmd[:2])} failed: {proc.stderr.strip() or proc.returncode}")
    try:
        yield mnt
    finally:
        # lazily: a failed test's traceback may still hold a mapping of a file in it
        subprocess.run(["umount", "--lazy", str(mnt)], check=True)
        image.unlink()


def used(mount: Path) -> int:
    """Bytes in use on ``mount``'s filesystem once settled: synced, and read again until
    two reads 0.2 s apart agree (XFS frees a removed file's blocks in the background)."""
    last = -1
    while True:
        os.sync()
        st = os.statvfs(mount)
        now = (st.f_blocks - st.f_bfree) * st.f_frsize
        if now == last:
            return now
        last = now
        time.sleep(0.2)
