"""Building an `AccumulatingModel` functionally, as `Model(inputs, outputs)`.

`keras.Model.__new__` makes a model built from inputs and outputs a
`Functional` one by mixing that class in. A subclass of `keras.Model`
must do the same itself, and tell the calls that build functionally from
those of a subclass with arguments of its own.
"""

from __future__ import annotations

import functools
import inspect

import keras

from tfmemsafe import _compat


def _functional_arguments(args, kwargs) -> bool:
    """Whether a model is being built as `Model(inputs, outputs)`."""
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


def builds_functionally(cls, args, kwargs) -> bool:
    """Whether `cls(*args, **kwargs)` builds a functional model.

    Only a class that takes a functional model's arguments does: one with
    no `__init__` of its own, or one that passes `*args, **kwargs` on (the
    test Keras' `Model.from_config` makes). A subclass with arguments of
    its own is built by its `__init__`, as with `keras.Model`:
    `GAN(generator, discriminator)` is not `Model(inputs, outputs)`.
    """
    if not _functional_arguments(args, kwargs):
        return False
    functional = _compat.functional_class()
    if functional is None:
        raise NotImplementedError(
            f"This Keras has no functional model class to build a "
            f"{cls.__name__} as Model(inputs, outputs) with. Instead, build "
            "keras.Model(inputs, outputs) and pass it to "
            "tfmemsafe.with_gradient_accumulation(model, accumulation_steps)."
        )
    if issubclass(cls, functional):
        return False
    # `AccumulatingModel.__init__` itself takes `*args, **kwargs`.
    spec = inspect.getfullargspec(cls.__init__)
    return spec.varargs is not None and spec.varkw is not None


@functools.cache
def functional_variant(cls):
    """`cls` with `Functional` mixed in, for `cls(inputs, outputs)`.

    Keras would instead rewrite `cls.__bases__` in place, which breaks
    every later subclass of `cls` that is not built functionally.
    """
    variant = type(
        cls.__name__,
        (cls, _compat.functional_class()),
        {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        },
    )
    # Saved under the name of `cls`, so loading rebuilds it through `cls`.
    _compat.save_under_name(variant, keras.saving.get_registered_name(cls))
    return variant
