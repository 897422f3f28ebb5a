"""Source: a lazy index of a checkpoint's tensors, from headers alone."""

from streamck.source.checkpoint import Checkpoint, FileStamp, open_checkpoint
from streamck.source.header import Header, TensorRef, read_header

__all__ = ["Checkpoint", "FileStamp", "Header", "TensorRef", "open_checkpoint", "read_header"]
