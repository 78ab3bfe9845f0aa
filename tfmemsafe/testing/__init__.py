"""Run code in a fresh Python process, optionally under a real memory cap.

TensorFlow reads its allocator settings once, when it is imported, and
keeps global state (the dtype policy, logical devices) for the life of the
process. Tests of that state, and tests that need a genuine
`ResourceExhaustedError` on a machine without a GPU, therefore run in a
child process. `run_with_memory_cap` starts one whose CPU allocator is
capped, so TensorFlow really runs out of memory, and raises the error
back in the parent where `tfmemsafe.is_oom_error` recognises it.
`run_workers` starts a local multi-worker cluster of such processes, and
`AllocatorFailures` counts the allocator's own out-of-memory reports and
`training_peak_bytes` reads its peak. `HeldMemory` fills the capped
allocator at a chosen step, as memory that something else holds. For
tests in this process, `OutOfMemoryAbove` raises the error inside the
step on batches above some rows, and `SimulatedOutOfMemory` from a
callback at chosen steps; `reference_model`, `random_data` and
`random_images` give seeded networks and data that tests and benchmarks
share. With `TFMEMSAFE_TESTING_PRELOAD=1`, children are forked from a
process that has TensorFlow and Keras imported instead of importing them
each.
"""

from tfmemsafe.testing._allocator import AllocatorFailures
from tfmemsafe.testing._allocator import memory_cap_environment
from tfmemsafe.testing._allocator import training_peak_bytes
from tfmemsafe.testing._child import SubprocessError
from tfmemsafe.testing._held_memory import HeldMemory
from tfmemsafe.testing._reference import random_data
from tfmemsafe.testing._reference import random_images
from tfmemsafe.testing._reference import reference_model
from tfmemsafe.testing._runners import run_in_subprocess
from tfmemsafe.testing._runners import run_with_memory_cap
from tfmemsafe.testing._runners import run_workers
from tfmemsafe.testing._simulated_oom import OutOfMemoryAbove
from tfmemsafe.testing._simulated_oom import SimulatedOutOfMemory

__all__ = [
    "AllocatorFailures",
    "HeldMemory",
    "OutOfMemoryAbove",
    "SimulatedOutOfMemory",
    "SubprocessError",
    "memory_cap_environment",
    "random_data",
    "random_images",
    "reference_model",
    "run_in_subprocess",
    "run_with_memory_cap",
    "run_workers",
    "training_peak_bytes",
]
