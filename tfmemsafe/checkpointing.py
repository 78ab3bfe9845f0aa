"""Gradient checkpointing for Keras 3 layers on TensorFlow.

`Checkpointed(layer)` keeps only the inputs of `layer` during the forward
pass and recomputes its activations in the backward pass, trading compute
for memory. `checkpoint_blocks(blocks)` applies it to a chain of blocks in
about sqrt(n) segments.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence

import keras
import tensorflow as tf
from absl import logging

# Keras 3.15 has no public equivalent of these: `keras.StatelessScope` and
# `keras.SymbolicScope` are public but not `in_stateless_scope()` and
# `in_symbolic_scope()` (asking whether one is active), nor
# `AutocastScope`; and the `SeedGenerator` behind unseeded `keras.random`
# calls is created by `global_seed_generator()` and kept in Keras' global
# state with no public accessor.
from keras.src import backend as keras_backend
from keras.src.backend.common import global_state as keras_global_state
from keras.src.random.seed_generator import global_seed_generator

# Pauses every active gradient tape, as `tf.recompute_grad` does.
from tensorflow.python.eager import record as tape_record

from tfmemsafe import _checks

# TensorFlow ops whose random numbers come from hidden state. A block that
# uses them gives different numbers when it is recomputed, so its gradient
# would not match its forward pass.
_STATEFUL_RANDOM_OPS = frozenset(
    [
        "Multinomial",
        "ParameterizedTruncatedNormal",
        "RandomCrop",
        "RandomGamma",
        "RandomPoisson",
        "RandomPoissonV2",
        "RandomShuffle",
        "RandomStandardNormal",
        "RandomUniform",
        "RandomUniformInt",
        "RngReadAndSkip",
        "RngSkip",
        "StatefulRandomBinomial",
        "StatefulStandardNormal",
        "StatefulStandardNormalV2",
        "StatefulTruncatedNormal",
        "StatefulUniform",
        "StatefulUniformFullInt",
        "StatefulUniformInt",
        "TruncatedNormal",
    ]
)


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
        global_seed_generator()

    def get_config(self):
        return {**super().get_config(), "recompute": self.recompute}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        # `Wrapper.from_config` pops "layer" from the caller's dict.
        return super().from_config(dict(config), custom_objects)

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    def compute_output_spec(self, inputs, training=None):
        return self.layer.compute_output_spec(inputs)

    def call(self, inputs, training=None):
        kwargs = {"training": training} if self._layer_takes_training else {}
        if (
            keras_backend.in_symbolic_scope()
            or keras_backend.in_stateless_scope()
        ):
            # Shape inference, or a stateless call whose variable values
            # live in the scope and would not receive gradients through
            # the recomputation: run the layer as it is.
            if (
                not keras_backend.in_symbolic_scope()
                and not self._warned_not_checkpointed
            ):
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
        generator = keras_global_state.get_global_attribute(
            "global_seed_generator"
        )
        if generator is not None:
            state.append(generator.state)
        with keras_backend.AutocastScope(None):
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

        results = _checkpoint(
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
        found = sorted(_stateful_random_op_types(graph, operations))
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


def checkpoint_blocks(
    blocks: Sequence[keras.layers.Layer],
    segments: int | None = None,
    checkpoint_last: bool = False,
) -> list[Checkpointed]:
    """Groups a chain of blocks into segments and checkpoints the segments.

    The sqrt(n) scheme of Chen et al. (2016), "Training Deep Nets with
    Sublinear Memory Cost": of `n` chained blocks, only the inputs of
    about sqrt(n) segments are kept through the forward pass, and each
    segment is recomputed in the backward pass, so activation memory grows
    like sqrt(n) instead of n.

    The last segment is not recomputed by default: the backward pass
    starts with it, so recomputing it would rebuild at once the
    activations it had just freed, costing time and saving nothing. It is
    wrapped in `Checkpointed(..., recompute=False)`, which keeps its
    activations but frees them, with all its gradients, before the
    recomputation of the other segments begins. Set `checkpoint_last=True`
    when large layers follow the blocks (a wide classifier head) and the
    last segment's activations should not wait through them.

    Each block must take one tensor and return one tensor, as in a
    `keras.Sequential`. Apply the returned layers in order:
    `for layer in checkpoint_blocks(blocks): x = layer(x)`, or
    `keras.Sequential(checkpoint_blocks(blocks))`.

    Args:
        blocks: Sequence of `keras.layers.Layer`. The blocks, in the order
            they are applied.
        segments: int. The number of segments, between 1 and
            `len(blocks)`; segment lengths differ by at most one, longer
            segments first. Defaults to `round(sqrt(len(blocks)))`.
        checkpoint_last: bool. Whether to recompute the last segment too.
            Defaults to `False`.

    Returns:
        A list of `segments` `Checkpointed` layers to apply in order, each
        wrapping a segment (a `keras.Sequential` when it has several
        blocks); the last has `recompute=False` unless `checkpoint_last`.

    Raises:
        ValueError: If `blocks` is empty or holds something other than
            layers, if `segments` is out of range, or if `checkpoint_last`
            is not a bool.

    Example:
    >>> blocks = [keras.layers.Dense(64, activation="relu") for _ in range(9)]
    >>> layers = checkpoint_blocks(blocks)  # 3 segments of 3 blocks
    >>> [layer.recompute for layer in layers]
    [True, True, False]
    >>> model = keras.Sequential([keras.Input((64,)), *layers])
    """
    blocks = list(blocks)
    if not blocks or not all(isinstance(b, keras.layers.Layer) for b in blocks):
        raise ValueError(
            "`blocks` must be a non-empty sequence of `keras.layers.Layer`. "
            f"Received: blocks={blocks!r}"
        )
    if segments is None:
        segments = max(1, round(math.sqrt(len(blocks))))
    if (
        isinstance(segments, bool)
        or not isinstance(segments, int)
        or not 1 <= segments <= len(blocks)
    ):
        raise ValueError(
            "`segments` must be an integer between 1 and len(blocks)="
            f"{len(blocks)}. Received: segments={segments!r}"
        )
    if not isinstance(checkpoint_last, bool):
        raise ValueError(
            "`checkpoint_last` must be True or False. "
            f"Received: checkpoint_last={checkpoint_last!r}"
        )
    groups = []
    start = 0
    for index in range(segments):
        size = len(blocks) // segments + (index < len(blocks) % segments)
        groups.append(blocks[start : start + size])
        start += size
    return [
        Checkpointed(
            group[0] if len(group) == 1 else keras.Sequential(group),
            recompute=checkpoint_last or index < segments - 1,
        )
        for index, group in enumerate(groups)
    ]


def _checkpoint(function, args, recompute):
    """Calls `function(*args)` under a custom gradient.

    With `recompute`, the forward pass records nothing and the backward
    pass runs `function` again, as `tf.recompute_grad` does, but without
    keyword arguments (which graph-mode custom gradients reject). Without
    it, the activations are recorded and kept as usual.

    Either way all gradients of the call are released together. TensorFlow
    otherwise runs the gradient of a block's input early (it leads to the
    next block) and its weight gradients late, keeping the block's
    activations alive through the recomputation of the blocks before it;
    the saving would then depend on the order the graph happens to run in.
    """

    @tf.custom_gradient
    def forward(*inputs):
        if recompute:
            with tape_record.stop_recording():
                results = function(*inputs)
        else:
            recording = tf.GradientTape(persistent=True)
            with recording:
                recording.watch(inputs)
                results = function(*inputs)

        def backward(*output_gradients, variables=None):
            variables = list(variables or [])
            sources = list(inputs)
            if recompute:
                if not tf.executing_eagerly():
                    sources = _after(output_gradients[0], sources)
                with tf.GradientTape() as tape:
                    tape.watch(sources)
                    tape.watch(variables)
                    targets = function(*sources)
            else:
                tape, targets = recording, results
            gradients = tape.gradient(
                targets,
                sources + variables,
                output_gradients=list(output_gradients),
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
            with tf.control_dependencies(gradients):
                gradients = [tf.identity(g) for g in gradients]
            if variables:
                return gradients[: len(sources)], gradients[len(sources) :]
            return gradients

        return results, backward

    return forward(*args)


def _after(tensor, inputs):
    """`inputs`, made to depend on `tensor` through data, not control.

    XLA ignores control dependencies, and graph optimizations could merge
    a recomputation that does not depend on the output gradient with the
    forward pass. The same device as `tf.recompute_grad` uses.
    """
    first = tf.reshape(tensor, [-1])[:1]
    flag = tf.cast(tf.reduce_max(first), tf.bool)
    zero = tf.where(tf.equal(flag, flag), 0.0, float("nan"))
    return [x + tf.cast(zero, x.dtype) for x in inputs]


def _is_float_tensor(x) -> bool:
    return tf.is_tensor(x) and x.dtype.is_floating


def _stateful_random_op_types(graph, operations) -> set[str]:
    """The stateful random op types among `operations` and their functions."""
    found = set()
    library = None
    for op in operations:
        if op.type in _STATEFUL_RANDOM_OPS:
            found.add(op.type)
        function_names = _called_functions(op.node_def)
        if function_names:
            if library is None:
                library = {
                    f.signature.name: f
                    for f in graph.as_graph_def().library.function
                }
            found |= _stateful_random_ops_in_functions(function_names, library)
    return found


def _stateful_random_ops_in_functions(names, library) -> set[str]:
    found, seen, pending = set(), set(), list(names)
    while pending:
        name = pending.pop()
        if name in seen or name not in library:
            continue
        seen.add(name)
        for node in library[name].node_def:
            if node.op in _STATEFUL_RANDOM_OPS:
                found.add(node.op)
            pending.extend(_called_functions(node))
    return found


def _called_functions(node_def) -> list[str]:
    names = []
    for value in node_def.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        names.extend(f.name for f in value.list.func)
    return names
