"""Data: datasets for the examples, and batches sized by memory.

Owns the example datasets (`cifar10` through TFDS, the offline `digits`),
unbatched so that `tfmemsafe.fit` can batch them at any size, and the
length buckets of variable-length data (`memory_buckets`,
`bucket_by_memory`): each bucket batched at the largest size the memory
model predicts to fit at its length.
"""

from tfmemsafe.data._buckets import bucket_by_memory
from tfmemsafe.data._buckets import memory_buckets
from tfmemsafe.data._datasets import CIFAR10_CLASSES
from tfmemsafe.data._datasets import cifar10
from tfmemsafe.data._datasets import digits
from tfmemsafe.data._memory_buckets import MemoryBuckets

__all__ = [
    "CIFAR10_CLASSES",
    "MemoryBuckets",
    "bucket_by_memory",
    "cifar10",
    "digits",
    "memory_buckets",
]
