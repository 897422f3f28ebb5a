"""The S3 server the remote tests run: bench/seaweed.py (the bench's ``remote`` case runs it too)."""

import sys

from helpers import REPO

sys.path.insert(0, str(REPO / "bench"))
from seaweed import KEY, SECRET, S3Server, foreign_sockets, start, weed_binary

__all__ = ["KEY", "SECRET", "S3Server", "foreign_sockets", "start", "weed_binary"]
