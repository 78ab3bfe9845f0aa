"""Input checks shared by every public function, with Keras-style messages.

Each check names the argument, says what was expected and shows what was
received. A value of the wrong type raises `TypeError`; a value of the right
type but out of range raises `ValueError`, except for integers and
fractions, where Keras itself raises `ValueError` for both.
"""

from __future__ import annotations

import numbers

import keras


def integer(name: str, value, minimum: int = 1) -> int:
    """Returns `value` as an `int` if it is an integer >= `minimum`.

    Accepts Python and NumPy integers (anything `numbers.Integral`), as Keras
    does; refuses `bool`, although it is an `int`.

    Raises:
        ValueError: Otherwise, naming `name`.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < minimum
    ):
        raise ValueError(
            f"`{name}` must be an integer >= {minimum}. "
            f"Received: {name}={value!r}"
        )
    return int(value)


def is_integer(value, minimum: int = 1) -> bool:
    """Whether `integer(..., value, minimum)` would accept `value`."""
    return (
        isinstance(value, numbers.Integral)
        and not isinstance(value, bool)
        and value >= minimum
    )


def fraction(
    name: str,
    value,
    *,
    low: float = 0.0,
    high: float = 1.0,
    low_closed: bool = True,
    high_closed: bool = False,
    what: str = "a fraction",
    extra: str = "",
) -> float:
    """Returns `value` as a `float` if it is a number in the interval.

    The interval is `[low, high)` by default; `low_closed` and `high_closed`
    choose the brackets. The message says "`name` must be {what} in
    {interval}{extra}", e.g. with `extra=", or None to turn it off"`.

    Raises:
        ValueError: Otherwise, naming `name`.
    """
    inside = (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and (low <= value if low_closed else low < value)
        and (value <= high if high_closed else value < high)
    )
    if not inside:
        interval = (
            f"{'[' if low_closed else '('}{low:g}, "
            f"{high:g}{']' if high_closed else ')'}"
        )
        raise ValueError(
            f"`{name}` must be {what} in {interval}{extra}. "
            f"Received: {name}={value!r}"
        )
    return float(value)


def boolean(name: str, value) -> bool:
    """Returns `value` if it is `True` or `False`.

    Raises:
        ValueError: Otherwise, naming `name`.
    """
    if not isinstance(value, bool):
        raise ValueError(
            f"`{name}` must be True or False. Received: {name}={value!r}"
        )
    return value


def one_of(name: str, value, allowed) -> None:
    """Refuses a `value` that is not one of `allowed`.

    Raises:
        ValueError: Naming `name`, what it may be and what it was.
    """
    if value not in allowed:
        raise ValueError(
            f"`{name}` must be one of {', '.join(map(repr, allowed))}. "
            f"Received: {name}={value!r}"
        )


def verbose(value) -> None:
    """`verbose` as `model.fit` takes it: `"auto"`, 0, 1 or 2."""
    one_of("verbose", value, ("auto", 0, 1, 2))


def model(value, name: str = "model") -> keras.Model:
    """Returns `value` if it is a `keras.Model`.

    Raises:
        TypeError: Otherwise.
    """
    if not isinstance(value, keras.Model):
        raise TypeError(
            f"`{name}` must be a keras.Model. Received: {name}={value!r:.80} "
            f"of type {type(value).__name__}"
        )
    return value


def compiled_model(value, function: str) -> keras.Model:
    """Returns `value` if it is a compiled `keras.Model`.

    Args:
        value: What was passed as `model`.
        function: The public function that needs it, e.g. `"fit"`.

    Raises:
        TypeError: If it is not a `keras.Model`.
        ValueError: If it is not compiled.
    """
    model(value)
    if not value.compiled:
        raise ValueError(
            f"`model` must be compiled before `tfmemsafe.{function}`: call "
            "model.compile(optimizer=..., loss=...) first."
        )
    return value


def callbacks(value) -> list:
    """Returns the callbacks as a new list.

    Accepts `None`, a single `keras.callbacks.Callback`, a list, a
    `keras.callbacks.CallbackList`, or any iterable of callbacks.

    Raises:
        TypeError: If it, or an element, is not a callback.
    """
    if isinstance(value, keras.callbacks.CallbackList):
        value = value.callbacks
    elif isinstance(value, keras.callbacks.Callback):
        value = [value]
    elif value is not None and not hasattr(value, "__iter__"):
        raise TypeError(
            "`callbacks` must be a keras.callbacks.Callback or a list of "
            f"them. Received: callbacks={value!r:.80} of type "
            f"{type(value).__name__}"
        )
    value = list(value or [])
    for callback in value:
        if not isinstance(callback, keras.callbacks.Callback):
            raise TypeError(
                "`callbacks` must be a list of keras.callbacks.Callback. "
                f"Received an element {callback!r:.80} of type "
                f"{type(callback).__name__}"
            )
    return value


def retry_limits(min_batch_size, max_retries) -> None:
    """Checks `min_batch_size` (>= 1) and `max_retries` (>= 0 or `None`)."""
    integer("min_batch_size", min_batch_size, 1)
    if max_retries is not None:
        integer("max_retries", max_retries, 0)


def start_sizes(min_batch_size: int, **sizes: int | None) -> None:
    """Refuses a batch size to start at that is below `min_batch_size`."""
    for name, size in sizes.items():
        if size is not None and size < min_batch_size:
            raise ValueError(
                f"`min_batch_size` must be <= `{name}`, the batch size to "
                f"start at. Received: min_batch_size={min_batch_size}, "
                f"{name}={size}"
            )
