"""`Checkpointed`: a layer whose activations are recomputed, not stored.

The wrapper runs its layer under a custom gradient (`_recompute.py`)
that recomputes it in the backward pass, from the same weights and with
the same `keras.random` seeds, and refuses layers whose TensorFlow
random ops could not be replayed (`_random_ops.py`).
"""

from __future__ import annotations

import inspect
import random

import keras
import tensorflow as tf
from absl import logging

from tfmemsafe import _checks
from tfmemsafe import _compat
from tfmemsafe.checkpointing import _random_ops
from tfmemsafe.checkpointing import _recompute


@keras.saving.register_keras_serializable(package="tfmemsafe")
class Checkpointed(keras.layers.Wrapper):
    """Recomputes a layer's activations in the backward pass.

    During training, a layer normally keeps every intermediate tensor of
    its forward pass until the backward pass has used it. `Checkpointed`
    keeps only the layer's inputs: the forward pass runs without recording
    intermediates, and the backward pass runs the layer again to rebuild
    them, as `tf.recompute_grad` does. Peak memory falls by roughly the
    activations inside the wrapped layer; each training step costs one
    extra forward pass of it.

    Wrap blocks of several layers (a residual block, a transformer block,
    a `keras.Sequential` of them) rather than single layers: the saving is
    what lives inside the block, and the block's input is kept anyway.
    Use `checkpoint_blocks` to wrap a chain of blocks in segments.

    The recomputation sees the same state as the forward pass:

    - Random layers built on `keras.random` (`Dropout`, `GaussianNoise`,
      `SpatialDropout2D`, the random augmentation layers, unseeded
      `keras.random.*` calls) draw the same numbers again, because their
      `SeedGenerator` states are replayed. Blocks that use TensorFlow's
      stateful random ops (`tf.random.uniform`, `tf.nn.dropout`,
      `tf.random.Generator`) cannot be replayed and are refused with a
      `ValueError`.
    - Non-trainable state updated in the forward pass (the moving mean and
      variance of `BatchNormalization`) is updated once per step, by the
      forward pass; the recomputation reads the values from before the
      step and its updates are discarded.
    - Losses added inside the block (`add_loss`, activity regularizers)
      are kept and differentiated through the recomputation.
    - The recomputation uses the weights of the forward pass, passed to it
      as tensors. (A plain `tf.recompute_grad` reads the variables again,
      and in `fit` the optimizer may already have updated some of them.)

    Works in functional, `Sequential` and subclassed models, eagerly and
    in `fit` (graph mode), with `jit_compile=True` (where XLA's scheduling
    favours one wrapper per block over segments), under mixed precision
    and under `tf.distribute.MirroredStrategy`. Masks are not propagated
    through the wrapper.

    Args:
        layer: `keras.layers.Layer`. The layer or model to wrap, built or
            not.
        recompute: bool. Whether to recompute the layer in the backward
            pass. `False` keeps its activations, as without checkpointing,
            but still releases all of its gradients at once, which frees
            those activations before the backward pass moves on to the
            recomputation of earlier blocks (`checkpoint_blocks` uses it
            for the last segment). Defaults to `True`.
        **kwargs: Base layer arguments (`name`, `dtype`, ...). `dtype`
            defaults to the wrapped layer's dtype policy.

    Example:
    >>> block = keras.Sequential([
    ...     keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
    ...     keras.layers.BatchNormalization(),
    ...     keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
    ... ])
    >>> inputs = keras.Input((32, 32, 16))
    >>> outputs = keras.layers.Add()([inputs, Checkpointed(block)(inputs)])
    >>> model = keras.Model(inputs, outputs)
    """

    def __init__(
        self, layer: keras.layers.Layer, recompute: bool = True, **kwargs
    ):
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                "`layer` must be a `keras.layers.Layer` or `keras.Model`. "
                f"Received: layer={layer!r} of type {type(layer).__name__}"
            )
        _checks.boolean("recompute", recompute)
        kwargs.setdefault("dtype", layer.dtype_policy)
        super().__init__(layer, **kwargs)
        self.recompute = recompute
        self._layer_takes_training = (
            "training" in inspect.signature(layer.call).parameters
        )
        self._random_ops_checked = False
        self._warned_not_checkpointed = False

    def build(self, input_shape=None):
        super().build(input_shape)
        # Unseeded `keras.random` calls create this generator on first use;
        # create it now so that its state can be replayed like any other.
        # Its seed comes from Python's random state without drawing from
        # it (Keras would draw it), so that the layers made after this one
        # get the seeds they would get without it. (Its integers hash
        # alike in every process.)
        state = random.getstate()
        random.seed(hash((state[1], 1)))
        try:
            _compat.global_seed_generator(create=True)
        finally:
            random.setstate(state)

    def get_config(self):
        return {**super().get_config(), "recompute": self.recompute}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # `Wrapper.from_config` pops "layer" from the caller's dict.
        return super().from_config(dict(config), custom_objects)

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    def compute_output_spec(self, inputs, training=None, mask=None):
        return self.layer.compute_output_spec(inputs)

    def call(self, inputs, training=None, mask=None):
        # `mask` is accepted because Keras passes it (cloning a functional
        # model passes `mask=None`); it is not propagated (class docstring).
        del mask
        kwargs = {"training": training} if self._layer_takes_training else {}
        symbolic = _compat.in_symbolic_scope()
        if symbolic or _compat.in_stateless_scope():
            # Shape inference, or a stateless call whose variable values
            # live in the scope and would not receive gradients through
            # the recomputation: run the layer as it is.
            if not symbolic and not self._warned_not_checkpointed:
                logging.warning(
                    "Checkpointed layer '%s' was called inside a "
                    "keras.StatelessScope; it runs without checkpointing "
                    "there.",
                    self.name,
                )
                self._warned_not_checkpointed = True
            return self.layer(inputs, **kwargs)
        check_randomness = self.recompute and not self._random_ops_checked
        if tf.executing_eagerly() and check_randomness:
            self._check_randomness_by_tracing(inputs, kwargs)

        flat_inputs = keras.tree.flatten(inputs)
        float_positions = [
            i for i, x in enumerate(flat_inputs) if _is_float_tensor(x)
        ]
        # The wrapped layer reads every variable from values taken here,
        # in both passes: trainable weights become differentiable inputs
        # of the recomputed function, and non-trainable state (seeds,
        # moving statistics) a constant snapshot. Data dependencies, not
        # the order in which the graph runs variable reads and the
        # optimizer's writes, then guarantee that the recomputation sees
        # the same weights and draws the same random numbers.
        weights = list(self.layer.trainable_variables)
        state = list(self.layer.non_trainable_variables)
        # Keras keeps this generator per thread: `build` created it in the
        # building thread; the replica threads of a `tf.distribute`
        # strategy have none (and Keras cannot make one there either).
        known, generator = _compat.global_seed_generator()
        autocast_off = _compat.autocast_off()
        if not known or autocast_off is None:
            return self.layer(inputs, **kwargs)  # `_compat` warned.
        if generator is not None:
            state.append(generator.state)
        with autocast_off:
            weight_values = [tf.identity(v.value) for v in weights]
            state_values = [tf.identity(v.value) for v in state]
        forward_outputs = []

        def run(*args):
            recomputing = bool(forward_outputs)
            flat = list(flat_inputs)
            for position, tensor in zip(
                float_positions, args[: len(float_positions)], strict=True
            ):
                flat[position] = tensor
            mapping = list(
                zip(weights, args[len(float_positions) :], strict=True)
            )
            mapping += list(zip(state, state_values, strict=True))
            with keras.StatelessScope(
                state_mapping=mapping, collect_losses=True
            ) as scope:
                before = [scope.get_current_value(v) for v in state]
                outputs = self._call_layer(
                    keras.tree.pack_sequence_as(inputs, flat),
                    kwargs,
                    recomputing,
                )
            if not recomputing:
                # Only the forward pass updates the state; the updates of
                # the recomputation are dropped with its scope.
                for variable, old in zip(state, before, strict=True):
                    new = scope.get_current_value(variable)
                    if new is not old:
                        variable.assign(new)
                forward_outputs.append(outputs)
            return keras.tree.flatten(outputs) + list(scope.losses)

        results = _recompute.checkpoint(
            run,
            [flat_inputs[i] for i in float_positions] + weight_values,
            self.recompute,
        )
        outputs = forward_outputs[0]
        num_outputs = len(keras.tree.flatten(outputs))
        for loss in results[num_outputs:]:
            self.add_loss(loss)
        return keras.tree.pack_sequence_as(outputs, results[:num_outputs])

    def _call_layer(self, inputs, kwargs, recomputing):
        if recomputing or not self.recompute or tf.executing_eagerly():
            return self.layer(inputs, **kwargs)
        graph = tf.compat.v1.get_default_graph()
        first_op = len(graph.get_operations())
        outputs = self.layer(inputs, **kwargs)
        self._check_randomness(graph, graph.get_operations()[first_op:])
        return outputs

    def _check_randomness_by_tracing(self, inputs, kwargs):
        specs = keras.tree.map_structure(
            lambda x: tf.TensorSpec.from_tensor(tf.convert_to_tensor(x)),
            inputs,
        )

        def trace(layer_inputs):
            with keras.StatelessScope(collect_losses=True):
                return self.layer(layer_inputs, **kwargs)

        graph = tf.function(trace).get_concrete_function(specs).graph
        self._check_randomness(graph, graph.get_operations())

    def _check_randomness(self, graph, operations):
        found = sorted(_random_ops.stateful_random_op_types(graph, operations))
        self._random_ops_checked = True
        if found:
            raise ValueError(
                f"`Checkpointed` cannot wrap layer '{self.layer.name}': it "
                "uses TensorFlow's stateful random ops "
                f"({', '.join(found)}), which draw different numbers when "
                "the layer is recomputed in the backward pass, so its "
                "gradients would not match its outputs. Instead, draw "
                "random numbers with `keras.random` and a "
                "`keras.random.SeedGenerator` (as `keras.layers.Dropout` "
                "does): Checkpointed replays those seeds."
            )


def _is_float_tensor(x) -> bool:
    return tf.is_tensor(x) and x.dtype.is_floating
