"""The model a plan trains when it recomputes: one that shares every layer.

`checkpointed(model)` builds a model that computes what `model` computes,
with its blocks wrapped in `tfmemsafe.Checkpointed`, from the same layer
objects: it holds the same variables, so training it trains `model`, and
it is compiled with `model`'s own optimizer, loss and metrics.
"""

from __future__ import annotations

import keras

from tfmemsafe import _compat
from tfmemsafe.checkpointing import Checkpointed
from tfmemsafe.checkpointing import checkpoint_blocks


def checkpointed(model: keras.Model) -> tuple[keras.Model | None, str]:
    """`model` with its blocks recomputed in the backward pass, sharing
    its layers, and compiled as it is; or `None` and why not.

    A `keras.Sequential` is checkpointed in about sqrt(n) segments of its
    layers (`checkpoint_blocks`). A functional model has each of its
    blocks wrapped: a nested model or a layer of the user's own class,
    the last of them kept rather than recomputed (the backward pass
    starts there). A model of another class (subclassed, an
    `AccumulatingModel`, one with its own `train_step`) is not rebuilt.
    """
    if type(model) is keras.Sequential:
        variant, why = _sequential(model)
    elif type(model) is _compat.functional_class():
        variant, why = _functional(model)
    else:
        # A class of its own (a subclassed model, an `AccumulatingModel`,
        # a functional model with its own `train_step`) may hold what a
        # rebuilt model would lose.
        return None, (
            f"a model of its own class ({type(model).__name__}) is not "
            "rebuilt: wrap its blocks in tfmemsafe.Checkpointed yourself"
        )
    if variant is None:
        return None, why
    variant.compile(**_compile_arguments(model))
    return variant, ""


def _sequential(model):
    layers = list(model.layers)
    if len(layers) < 2:
        return None, "a Sequential of one layer has no blocks to recompute"
    (spec,) = model.inputs
    inputs = keras.Input(batch_shape=spec.shape, dtype=spec.dtype)
    return keras.Sequential([inputs, *checkpoint_blocks(layers)]), ""


def _functional(model):
    blocks = [layer for layer in model.layers if _is_block(layer)]
    if not blocks:
        return None, (
            "the functional model has no blocks (nested models or layers of "
            "your own class) to recompute"
        )
    last = blocks[-1]

    def wrapped(layer):
        if layer not in blocks:
            return layer  # Shared, not copied.
        return Checkpointed(layer, recompute=layer is not last)

    return keras.models.clone_model(model, clone_function=wrapped), ""


def _is_block(layer) -> bool:
    if isinstance(layer, Checkpointed):
        return False  # Checkpointed already.
    if isinstance(layer, keras.Model):
        return True
    return not type(layer).__module__.startswith("keras")


def _compile_arguments(model) -> dict:
    """`model.compile`'s arguments from its compile config (public since
    Keras 3.0), with its own optimizer (state and all) and loss objects."""
    arguments = keras.saving.deserialize_keras_object(
        model.get_compile_config()
    )
    arguments["optimizer"] = model.optimizer
    arguments["loss"] = model.loss
    return arguments
