"""Writer: output layout computed up front, then tensor bytes moved in bounded chunks."""

from streamck.writer.engine import WriteResult, parse_size, rewrite
from streamck.writer.layout import Shard, header_bytes, index_bytes, plan_shards

__all__ = ["Shard", "WriteResult", "header_bytes", "index_bytes", "parse_size", "plan_shards", "rewrite"]
