"""Context parallelism: attention over a KV cache sharded by sequence across devices of this
process or the ranks of a torch.distributed process group (docs/contract.md "Past one device",
docs/distributed.md). Process groups need torch (``pip install 'attnreg[distributed]'``),
imported only when a group is used: shards on several Sessions of one process need nothing
more than attnreg."""

from __future__ import annotations

from .attention import sharded_attention
from .cache import ShardedKVCache
from .exchange import RankError

__all__ = ["RankError", "ShardedKVCache", "sharded_attention"]
