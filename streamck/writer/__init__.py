"""Writer: output layout computed up front, then tensor bytes moved in bounded chunks."""

from streamck.writer.digest import plan_digests
from streamck.writer.engine import WriteResult, parse_size, write_plan
from streamck.writer.layout import Shard, header_bytes, index_bytes, plan_shards

__all__ = [
    "Shard",
    "WriteResult",
    "header_bytes",
    "index_bytes",
    "parse_size",
    "plan_digests",
    "plan_shards",
    "write_plan",
]
