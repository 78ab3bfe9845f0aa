"""Out-of-memory errors told from every other failure.

`is_oom_error` classifies an exception; `_oom_messages` holds the message
shapes of TensorFlow, XLA, cuDNN, cuBLAS and CUDA that it recognises.
"""

from __future__ import annotations

import tensorflow as tf

from tfmemsafe.memory import _oom_messages


def is_oom_error(exc: BaseException | None) -> bool:
    """Tells whether an exception is an out-of-memory error.

    Counted: `tf.errors.ResourceExhaustedError` (unless its message says a
    disk, a file table or an RPC size limit ran out: TensorFlow reports
    those with the same code), and any other
    `tf.errors.OpError` or `RuntimeError` (XLA's `XlaRuntimeError`) whose
    message reports a failed allocation: XLA's "RESOURCE_EXHAUSTED" and
    "Out of memory while trying to allocate", "OOM when allocating", the
    `InternalError` "Dst tensor is not initialized" (a host-to-device copy
    that found no memory), CUDNN_STATUS_ALLOC_FAILED,
    CUBLAS_STATUS_ALLOC_FAILED, CUDA_ERROR_OUT_OF_MEMORY, a cuDNN workspace
    that could not be allocated, and the `InvalidArgumentError` "Cannot
    parse tensor from proto" when the proto it shows is valid (TensorFlow
    failed to allocate a constant, such as the zeros grappler makes for a
    gradient's AddN).

    Not counted: cuDNN or cuBLAS failing to initialize ("Failed to get
    convolution algorithm. This is probably because cuDNN failed to
    initialize", CUDNN_STATUS_NOT_INITIALIZED, CUBLAS_STATUS_NOT_INITIALIZED,
    "DNN library is not found"): the message does not say memory ran out,
    the usual cause is the installation, and a smaller batch does not give
    the library the memory it lacked. Nor other cuDNN/cuBLAS statuses,
    genuine parse errors, or a Python `MemoryError` (host memory).

    An exception that wraps an out-of-memory error counts too: one raised
    `from` it (`__cause__`), and one raised while handling it
    (`__context__`) whose message restates the original's, as wrappers do.
    An error that merely happened while an OOM was being handled, such as
    a callback's `ValueError` in an `except ResourceExhaustedError:` block,
    is not an OOM, so tfmemsafe never retries it.

    Args:
        exc: The exception to classify.

    Returns:
        `True` if it is an out-of-memory error.

    Example:
    >>> error = tf.errors.ResourceExhaustedError(None, None, "OOM")
    >>> tfmemsafe.is_oom_error(error)
    True
    >>> tfmemsafe.is_oom_error(ValueError("bad label shape"))
    False
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _is_oom_itself(exc):
            return True
        exc = _wrapped_error(exc)
    return False


def _wrapped_error(exc: BaseException) -> BaseException | None:
    """The error `exc` wraps, or `None`.

    `raise new from err` declares that `err` caused `new`. `__context__`
    only says that `new` was raised while `err` was being handled, which
    is true of any unrelated failure in an `except` block (a callback's
    bug, a failed cleanup), so it is followed only when the new error
    restates the old one's message. `__suppress_context__` is no guide:
    Keras re-raises every error from `fit` with `from None`.
    """
    if exc.__cause__ is not None:
        return exc.__cause__
    context = exc.__context__
    if context is None:
        return None
    inner = str(context).strip()
    if inner and inner in str(exc):
        return context
    return None


def _is_oom_itself(exc: BaseException) -> bool:
    if isinstance(exc, tf.errors.ResourceExhaustedError):
        # Also a full disk, too many open files or an oversized RPC.
        return not _oom_messages.is_other_resource_text(str(exc))
    if isinstance(exc, (tf.errors.OpError, RuntimeError)):
        return _oom_messages.is_allocation_failure_text(str(exc))
    return False
