"""Writer: output layout computed up front, then tensor bytes moved in bounded chunks.

A write is one sequence (streamck.writer.engine.write_plan) over a format
(streamck.writer.formats: what the files hold) and a destination
(streamck.writer.destination: where they go), with its options on one object
(streamck.writer.options.WriteOptions).
"""

from streamck.writer.digest import plan_digests
from streamck.writer.engine import WriteResult, parse_size, write_plan
from streamck.writer.layout import Shard, header_bytes, index_bytes, plan_shards
from streamck.writer.options import WriteOptions

__all__ = [
    "Shard",
    "WriteOptions",
    "WriteResult",
    "header_bytes",
    "index_bytes",
    "parse_size",
    "plan_digests",
    "plan_shards",
    "write_plan",
]
