"""tfmemsafe: train large Keras 3 / TensorFlow networks without OOM crashes.

Importing it turns on GPU memory growth, picks the dtype policy and gives
the CPU an allocator that keeps statistics (see `tfmemsafe.configure`);
set `TFMEMSAFE_AUTOCONFIGURE=0` to skip that.
"""

# First: TensorFlow reads its log level when imported (see the module).
from tfmemsafe import _tensorflow_logs  # noqa: F401, I001
from tfmemsafe import data
from tfmemsafe import distribute
from tfmemsafe import testing
from tfmemsafe.accumulation import AccumulatingModel
from tfmemsafe.accumulation import GradientAccumulator
from tfmemsafe.accumulation import with_gradient_accumulation
from tfmemsafe.checkpointing import Checkpointed
from tfmemsafe.checkpointing import checkpoint_blocks
from tfmemsafe.errors import DatasetUnavailableError
from tfmemsafe.errors import MemoryEstimateError
from tfmemsafe.errors import OutOfMemoryError
from tfmemsafe.estimate import MemoryEstimate
from tfmemsafe.estimate import estimate_memory
from tfmemsafe.history import FitHistory
from tfmemsafe.history import GrowBackEvent
from tfmemsafe.history import OOMEvent
from tfmemsafe.memory import MemoryInfo
from tfmemsafe.memory import default_devices
from tfmemsafe.memory import is_oom_error
from tfmemsafe.memory import memory_info
from tfmemsafe.memory import reset_peak_memory
from tfmemsafe.monitor import MemoryMonitor
from tfmemsafe.planning import MemoryPlan
from tfmemsafe.planning import plan
from tfmemsafe.training import evaluate
from tfmemsafe.planning import find_max_batch_size
from tfmemsafe.training import fit
from tfmemsafe.recovery import SplitBatchOnOOM
from tfmemsafe.training import predict
from tfmemsafe.runtime import RuntimeConfig
from tfmemsafe.runtime import configure
from tfmemsafe.runtime import runtime_config
from tfmemsafe.transfer import InferenceMode
from tfmemsafe.transfer import UnfreezeSummary
from tfmemsafe.transfer import build_frozen_mobilenet_v2
from tfmemsafe.transfer import cache_features
from tfmemsafe.transfer import fit_head
from tfmemsafe.transfer import unfreeze

__version__ = "0.1.0"

__all__ = [
    "AccumulatingModel",
    "Checkpointed",
    "DatasetUnavailableError",
    "FitHistory",
    "GradientAccumulator",
    "GrowBackEvent",
    "InferenceMode",
    "MemoryEstimate",
    "MemoryEstimateError",
    "MemoryInfo",
    "MemoryMonitor",
    "MemoryPlan",
    "OOMEvent",
    "OutOfMemoryError",
    "RuntimeConfig",
    "SplitBatchOnOOM",
    "UnfreezeSummary",
    "build_frozen_mobilenet_v2",
    "cache_features",
    "checkpoint_blocks",
    "configure",
    "data",
    "default_devices",
    "distribute",
    "estimate_memory",
    "evaluate",
    "find_max_batch_size",
    "fit",
    "fit_head",
    "is_oom_error",
    "memory_info",
    "plan",
    "predict",
    "reset_peak_memory",
    "runtime_config",
    "testing",
    "unfreeze",
    "with_gradient_accumulation",
]

from tfmemsafe import runtime as _runtime  # noqa: E402

_runtime.configure_from_environment()
