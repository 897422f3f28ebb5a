"""Source: a lazy index of a checkpoint's tensors, from headers alone."""

from streamck.source.checkpoint import open_checkpoint
from streamck.source.header import Header, TensorRef, read_header
from streamck.source.index import Checkpoint, FileStamp

__all__ = ["Checkpoint", "FileStamp", "Header", "TensorRef", "open_checkpoint", "read_header"]
