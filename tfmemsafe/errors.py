"""The library's own failure modes."""

from collections.abc import Iterable


class OutOfMemoryError(RuntimeError):
    """Training could not be made to fit in device memory.

    Raised by tfmemsafe when it has run out of ways to recover from an
    out-of-memory error (for example a micro-batch of `min_batch_size`
    rows ran out). The original error is chained as `__cause__` by
    `tfmemsafe.fit`, `evaluate` and `predict`; out of a plain `model.fit`
    (which re-raises errors `from None`) it is in `error`.

    Attributes:
        tried_batch_sizes: The batch sizes that were tried, in order.
        error: The out-of-memory error it comes from, or `None`.
    """

    def __init__(
        self,
        message: str,
        tried_batch_sizes: Iterable[int] = (),
        error: BaseException | None = None,
    ):
        super().__init__(message)
        self.tried_batch_sizes = tuple(tried_batch_sizes)
        self.error = error


class DatasetUnavailableError(RuntimeError):
    """A dataset could not be downloaded and no prepared copy was found.

    The download error, if there was one, is chained as `__cause__`.
    """


class MemoryEstimateError(RuntimeError):
    """`tfmemsafe.estimate_memory` could not measure the training step.

    The device keeps no memory statistics (on a CPU, TensorFlow's default
    allocator keeps none unless `TF_CPU_ALLOCATOR_USE_BFC=true`), or the
    measured peak did not grow with the batch size.
    """
