"""The S3 server the remote tests run: bench/seaweed.py (the bench's ``remote`` case runs it too),
with ``s3`` to run the CLI against it; tests/conftest.py's ``server`` starts one per test module."""

import sys

from helpers import REPO, cli

sys.path.insert(0, str(REPO / "bench"))
from seaweed import KEY, SECRET, S3Server, foreign_sockets, start, weed_binary

__all__ = ["KEY", "SECRET", "S3Server", "foreign_sockets", "s3", "start", "weed_binary"]


def s3(server, *args, counted: bool = False, env=None, **kw):
    """``streamck ARGS`` with the server's credentials and endpoint in the env, as the AWS CLI reads them."""
    return cli(*args, env={**server.env(counted), **(env or {})}, **kw)
