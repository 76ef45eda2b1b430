"""Dynamic embedding engine: hash table, row optimizers, sharding, dump and load."""
from .dump import DumpError, PendingDump, dump, dump_async, load, read_manifest
from .embedding import DynamicEmbedding, EmbeddingConfig, ShardedDynamicEmbedding, TableStats
from .hashing import EMPTY_KEY, shard_of
from .optimizers import OptimizerConfig
from .table import MISSING, ReferenceHashTable

__all__ = [
    "DumpError", "PendingDump", "dump", "dump_async", "load", "read_manifest",
    "DynamicEmbedding", "EmbeddingConfig", "ShardedDynamicEmbedding", "TableStats",
    "EMPTY_KEY", "shard_of", "OptimizerConfig", "MISSING", "ReferenceHashTable",
]
