"""The memory model: the peak memory of the real training step.

Owns `estimate_memory` and `MemoryEstimate`: it trains a few short steps
of the model itself at small batch sizes (its probes), reads the
allocator's peak for each, fits `fixed + per_sample x batch` and says
which batch fits a limit. The model is put back exactly as found. The
recovery loop asks it through `estimate_source`, on data it has already
checked.
"""

from tfmemsafe.estimate._estimate import MemoryEstimate
from tfmemsafe.estimate._estimate import estimate_memory
from tfmemsafe.estimate._estimate import estimate_source
from tfmemsafe.estimate._graph import bound_terms
from tfmemsafe.estimate._held import data_held_on
from tfmemsafe.estimate._held import data_on
from tfmemsafe.estimate._held import gradient_bytes
from tfmemsafe.estimate._held import held_bytes
from tfmemsafe.estimate._held import state_bytes
from tfmemsafe.estimate._lengths import resized_arguments
from tfmemsafe.estimate._probe import Probe
from tfmemsafe.estimate._probe import devices_of
from tfmemsafe.estimate._probe_sizes import FEWEST_PROBED
from tfmemsafe.estimate._result import largest_fitting

__all__ = [
    "FEWEST_PROBED",
    "MemoryEstimate",
    "Probe",
    "bound_terms",
    "data_held_on",
    "data_on",
    "devices_of",
    "estimate_memory",
    "estimate_source",
    "gradient_bytes",
    "held_bytes",
    "largest_fitting",
    "resized_arguments",
    "state_bytes",
]
