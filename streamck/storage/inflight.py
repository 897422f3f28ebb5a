"""Requests in flight per remote file, for what the current call opens or uploads: a context
(SourceSpec.remote_concurrency, the CLI's --remote-concurrency), never process-wide state."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

# Read where a remote file or an upload is made, on the calling thread (streamck.storage.remote).
REQUESTS: ContextVar[int | None] = ContextVar("streamck_requests_in_flight", default=None)


@contextmanager
def requests_in_flight(n: int | None) -> Iterator[None]:
    """Within the block, ``n`` requests in flight per file of a URL (None: as around the block:
    an enclosing block's, the environment's ``STREAMCK_REMOTE_CONCURRENCY``, or the default).
    Raises UsageError for ``n`` below 1."""
    if n is not None and n < 1:
        from streamck.errors import UsageError

        raise UsageError(f"remote concurrency {n}: must be at least 1")
    token = REQUESTS.set(n if n is not None else REQUESTS.get())
    try:
        yield
    finally:
        REQUESTS.reset(token)
