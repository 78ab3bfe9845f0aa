"""The model a plan trains when it recomputes: one that shares every layer.

`checkpointed(model)` builds a model that computes what `model` computes,
with its blocks wrapped in `tfmemsafe.Checkpointed`, from the same layer
objects: it holds the same variables, so training it trains `model`, and
it is compiled with `model`'s own optimizer and loss objects.
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
    starts there). Not rebuilt: a model of another class (subclassed, an
    `AccumulatingModel`, one with its own `train_step`), which would lose
    what its class adds; a model whose tensors carry masks, which
    `Checkpointed` does not pass on; and one whose compiled metrics
    cannot be made again from their config. `model` must be built.
    """
    if type(model) not in (keras.Sequential, _compat.functional_class()):
        return None, (
            f"a model of its own class ({type(model).__name__}) is not "
            "rebuilt: wrap its blocks in tfmemsafe.Checkpointed yourself"
        )
    if _carries_masks(model):
        return None, (
            "the model's tensors carry masks, which Checkpointed does not "
            "pass on"
        )
    try:
        arguments = _compile_arguments(model)
    except (TypeError, ValueError) as err:
        return None, (
            f"its compiled metrics cannot be made again from their config "
            f"({err}"[:160]
            + "); register them with keras.saving.register_keras_serializable"
        )
    with model.distribute_strategy.scope():
        if type(model) is keras.Sequential:
            variant, why = _sequential(model)
        else:
            variant, why = _functional(model)
        if variant is not None:
            variant.compile(**arguments)
    return variant, why


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

    # Cloned from an uncompiled model of the same graph: `clone_model`
    # compiles the clone of a compiled model from its config, with a
    # second optimizer and its state.
    graph = keras.Model(model.inputs, model.outputs)
    return keras.models.clone_model(graph, clone_function=wrapped), ""


def _is_block(layer) -> bool:
    if isinstance(layer, Checkpointed):
        return False  # Checkpointed already.
    if isinstance(layer, keras.Model):
        return True
    module = type(layer).__module__
    return module != "keras" and not module.startswith("keras.")


def _carries_masks(model) -> bool:
    """Whether a layer of `model` puts a mask on its output."""
    for layer in model.layers:
        try:
            outputs = keras.tree.flatten(layer.output)
        except (AttributeError, ValueError):
            continue  # Called more than once, or never: no one output.
        if any(_compat.has_keras_mask(tensor) for tensor in outputs):
            return True
    return False


def _compile_arguments(model) -> dict:
    """`model.compile`'s arguments from its compile config (public since
    Keras 3.0), with its own optimizer (state and all) and loss objects.

    Raises:
        TypeError, ValueError: Where the config cannot be deserialized
            (an unregistered metric).
    """
    arguments = keras.saving.deserialize_keras_object(
        {
            name: value
            for name, value in model.get_compile_config().items()
            if name not in ("optimizer", "loss")
        }
    )
    arguments["optimizer"] = model.optimizer
    arguments["loss"] = model.loss
    return arguments
