"""Keeps a step that runs out of memory from breaking every later step.

Grappler's memory optimizer rewrites an `AddN` of three or more tensors
(a gradient summed over a tensor's uses: attention's query, key, value
and residual) into a temporary variable that each input is added to,
destroyed once the sum is read. It does so where the step's static peak
is over 80% of the device's memory as Grappler sees it (the GPU's; the
CPU device's 256 MiB, whatever the allocator's limit) and the sum's
shape is fully known: batches of a fixed size, as `drop_remainder=True`,
the memory estimate's probes at other lengths and `find_max_batch_size`'s
trials make.

The temporary variable lives in the step's resource container, which for
an eager call of a `tf.function` is one container for the whole process,
cleaned only by a C API call that Python cannot make. So when the step
runs out of memory between making the variable and destroying it, the
variable stays (and its memory with it), and every later call that
rewrites the same `AddN` raises `AlreadyExistsError` ("Resource
__per_step_0/.../AddN_5/tmp_var"), at any batch size: retrying cannot
work (measured: a transformer encoder at length 512 under a 400 MB cap,
`find_max_batch_size` failed so at its second trial).

`without_per_step_variables()` turns that rewrite off for the functions
called inside it, and nothing else: Grappler's default memory
optimization is the rewrite and host swapping; inside it is host swapping
alone (`SWAPPING_HEURISTICS`). The cost is the rewrite's saving, where it
applied: a transformer step at batch 64 and length 216 peaked at 298 MiB
instead of 278 MiB. TensorFlow has no public switch for it, so this sets
the thread's function call options (`tensorflow.python.eager.context`,
private, read in `_compat`); where they are missing it changes nothing
and says so once.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf
from absl import logging

from tfmemsafe import _compat

# Per thread, as TensorFlow's function call options are: how many scopes
# are open, the options found before the first, and the ones it set.
_SCOPES = threading.local()
# Whether the options could not be set, once said.
_warned = False


@contextlib.contextmanager
def without_per_step_variables():
    """Functions called inside run without Grappler's `AddN` rewrite.

    Scopes nest: the outermost sets the options and puts back what it
    found, unless something else set the thread's options meanwhile (then
    those stay).
    """
    depth = getattr(_SCOPES, "depth", 0)
    if depth == 0:
        _SCOPES.found, _SCOPES.set = _set_options()
    _SCOPES.depth = depth + 1
    try:
        yield
    finally:
        _SCOPES.depth -= 1
        if _SCOPES.depth == 0:
            found, changed = _SCOPES.found, _SCOPES.set
            _SCOPES.found = _SCOPES.set = None
            if changed is not None and _unchanged_since(changed):
                _compat.set_function_call_options(found)


def _unchanged_since(changed) -> bool:
    """Whether the thread's options are still the ones set (or a copy of
    them, as TensorFlow's `function_executor_type` puts back)."""
    current = _compat.function_call_options()
    return (
        current.executor_type == changed.executor_type
        and current.config_proto_serialized == changed.config_proto_serialized
    )


def _set_options():
    """`(found, set)`: the thread's options before and after; `set` is
    `None` when nothing was changed."""
    global _warned
    try:
        found = _compat.function_call_options()
        if found is None:
            return None, None  # Said by `_compat`.
        config = tf.compat.v1.ConfigProto.FromString(
            found.config_proto_serialized
        )
        options = config.graph_options.rewrite_options
        rewriter = type(options)
        if options.memory_optimization != rewriter.DEFAULT_MEM_OPT:
            # Set by the user (TensorFlow 1's session config): theirs.
            return found, None
        options.memory_optimization = rewriter.SWAPPING_HEURISTICS
        changed = _compat.make_function_call_options(
            found.executor_type, config
        )
        _compat.set_function_call_options(changed)
    except (ImportError, AttributeError, TypeError, ValueError) as error:
        if not _warned:
            _warned = True
            logging.warning(
                "tfmemsafe: could not turn off Grappler's AddN rewrite "
                "(%s); a step that runs out of memory may then make later "
                "steps raise AlreadyExistsError.",
                error,
            )
        return None, None
    return found, changed
