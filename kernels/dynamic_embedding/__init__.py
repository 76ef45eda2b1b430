"""Dynamic embedding engine: hash table, row optimizers, table collections, sharding, dump
and load."""
from .collection import DynamicEmbeddingCollection, FeatureConfig
from .dump import DumpError, PendingDump, dump, dump_async, load, read_manifest
from .embedding import DynamicEmbedding, EmbeddingConfig, TableStats
from .sharded import ShardedDynamicEmbedding
from .hashing import EMPTY_KEY, shard_of
from .optimizers import OptimizerConfig
from .sharded_collection import ShardedDynamicEmbeddingCollection
from .table import ReferenceHashTable
from .table_base import MISSING

__all__ = [
    "DumpError", "PendingDump", "dump", "dump_async", "load", "read_manifest",
    "DynamicEmbedding", "DynamicEmbeddingCollection", "EmbeddingConfig", "FeatureConfig", "ShardedDynamicEmbedding",
    "ShardedDynamicEmbeddingCollection", "TableStats",
    "EMPTY_KEY", "shard_of", "OptimizerConfig", "MISSING", "ReferenceHashTable",
]
