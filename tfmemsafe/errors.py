"""The library's own failure modes and the message text they share."""

from collections.abc import Iterable

# What to try when halving the batch was not enough. Shared by every error
# and warning that tells a user their model does not fit.
OOM_ADVICE = (
    "Instead, try mixed precision (`tfmemsafe.configure("
    'precision="mixed_float16")` on a GPU), gradient checkpointing '
    "(`tfmemsafe.Checkpointed`), a frozen backbone "
    "(`tfmemsafe.build_frozen_mobilenet_v2`) or a smaller input."
)


class OutOfMemoryError(RuntimeError):
    """Training could not be made to fit in device memory.

    Raised by tfmemsafe when it has run out of ways to recover from an
    out-of-memory error (for example the batch size would fall below
    `min_batch_size`). The original `tf.errors.ResourceExhaustedError` is
    chained as `__cause__`.

    Attributes:
        tried_batch_sizes: The batch sizes that were tried, in order.
    """

    def __init__(self, message: str, tried_batch_sizes: Iterable[int] = ()):
        super().__init__(message)
        self.tried_batch_sizes = tuple(tried_batch_sizes)


def check_integer(name: str, value, minimum: int) -> None:
    """Raises the Keras-style `ValueError` unless `value` is an int >= minimum.

    `bool` is refused although it is an `int`.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"`{name}` must be an integer >= {minimum}. "
            f"Received: {name}={value!r}"
        )


def format_sizes(sizes: Iterable[int]) -> str:
    """Formats batch sizes as `"256, 128, 64"`."""
    return ", ".join(str(size) for size in sizes)


class DatasetUnavailableError(RuntimeError):
    """A dataset could not be downloaded and no prepared copy was found.

    The download error, if there was one, is chained as `__cause__`.
    """
