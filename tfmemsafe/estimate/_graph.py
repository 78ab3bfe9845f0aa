"""What the traced forward pass says about memory, before any probe.

`forward_bytes` traces the model's forward pass (`training=True`) into a
graph at a given batch size and length, without running it, and adds up
every op's output: the bytes of all its tensors, as though none were
freed. Two traces a batch apart give the exact bytes per sample; traces
at lengths one, two and four times a base length give which powers of
the length those bytes hold (attention's scores are quadratic in it, a
GRU's states linear). Tensors inside a loop's body (a recurrent layer's
step) are counted through the loop's outputs, which stack them.

`bound_terms` turns them into a bound on a training step's peak
that no probe is needed for: every forward tensor kept for the backward
pass, a gradient and a temporary as large beside each, plus the state,
its gradients and an update's temporaries. A batch under it fits
without measuring; the bound is loose (three to four times the measured
peak on the reference networks), so it only spares the probes of a batch
far from the limit.
"""

from __future__ import annotations

import typing

import keras
import numpy as np
import tensorflow as tf

# Forward tensors per sample kept at once, at most: each forward output,
# its gradient, and a temporary of its size (an op's workspace, a cast).
_PER_SAMPLE_COPIES = 3
# The state's own transient: its gradients, and an optimizer update's
# temporaries of the same size.
_STATE_COPIES = 2
# Input batches in flight: the one trained on, a prefetched one, one being
# assembled, and one more for a parallel map.
_INPUT_BATCHES = 4
# On CPUs without oneDNN, Eigen's convolution gradients unroll images into
# im2col buffers whose size Eigen caps, two at once: a constant that no
# tensor of the graph shows (docs/memory-estimate.md, "When the line
# bends").
_CONVOLUTION_BUFFERS = 96 * 2**20


class Traced(typing.NamedTuple):
    """What a traced forward pass holds.

    Attributes:
        sizes: dict. Each op output's name to its bytes.
        convolution: bool. Whether any op convolves.
    """

    sizes: dict
    convolution: bool


class PerSample(typing.NamedTuple):
    """What one more sample adds to the forward pass.

    Attributes:
        total: int. Bytes of all op outputs.
        largest: int. Bytes of the op output that grows most.
        convolution: bool. Whether any op convolves.
    """

    total: int
    largest: int
    convolution: bool


def forward_bytes(model, inputs, batch_size: int, length: int | None = None):
    """Bytes of every op output of the traced forward pass, or `None`.

    Args:
        model: A built `keras.Model`.
        inputs: A batch of the model's inputs (any batch size), whose
            specs give the shapes to trace at.
        batch_size: int. The batch size to trace at.
        length: int or `None`. The size to give axis 1 of every input
            that has one (a sequence's length); `None` keeps it.

    Returns:
        A `Traced`, or `None` when the model cannot be traced at that
        shape.
    """
    specs = keras.tree.map_structure(
        lambda x: tf.TensorSpec(
            _shape(x.shape, batch_size, length), tf.as_dtype(x.dtype)
        ),
        inputs,
    )
    function = tf.function(lambda x: model(x, training=True))
    try:
        graph = function.get_concrete_function(specs).graph
    except Exception:  # noqa: BLE001
        return None  # A model that cannot take this shape: no bound.
    sizes, convolution = {}, False
    for op in graph.get_operations():
        convolution = convolution or op.type.startswith("Conv")
        for output in op.outputs:
            shape = output.shape
            if (
                output.dtype in (tf.resource, tf.variant)
                or not shape.is_fully_defined()
            ):
                continue
            sizes[output.name] = (
                int(np.prod(shape.as_list(), dtype=np.int64))
                * output.dtype.size
            )
    return Traced(sizes, convolution)


def per_sample_bytes(model, inputs, length=None) -> PerSample | None:
    """What one more sample adds to the forward pass, or `None`.

    The difference of the traces at batch two and one, op output by op
    output (the two traces name their ops alike): the sum, and the
    largest (a weight read is as large at both and adds nothing).
    """
    one = forward_bytes(model, inputs, 1, length)
    two = forward_bytes(model, inputs, 2, length)
    if one is None or two is None:
        return None
    grown = [
        max(size - one.sizes.get(name, 0), 0)
        for name, size in two.sizes.items()
    ]
    return PerSample(
        sum(grown), max(grown, default=0), one.convolution or two.convolution
    )


def length_powers(model, inputs, length: int) -> tuple[int, ...] | None:
    """The powers of the length the per-sample bytes hold: `(0, 1)` or
    `(0, 1, 2)`; `None` when the model cannot be traced at other lengths.

    From the forward pass traced at `length`, twice and four times it: for
    bytes `a + b l + c l^2`, `E(4l) - 3 E(2l) + 2 E(l) = 6 c l^2`.
    """
    sizes = []
    for factor in (1, 2, 4):
        traced = per_sample_bytes(model, inputs, factor * length)
        if traced is None:
            return None
        sizes.append(traced.total)
    curvature = sizes[2] - 3 * sizes[1] + 2 * sizes[0]
    # A sliver of quadratic bytes (a mask) is not worth a term to fit.
    if curvature > 0.01 * sizes[2]:
        return (0, 1, 2)
    return (0, 1)


def bound_terms(model, inputs, state_bytes: int):
    """`(fixed, per_sample)` bytes of the step's bound, or `None`.

    The bound at a batch (per replica device) is `fixed + per_sample x
    batch`. What the data keeps in memory (arrays' tensors, on a CPU) is
    not in it: the caller adds it per device (`data_on`).

    Args:
        model: A built, compiled `keras.Model`.
        inputs: A batch of its inputs.
        state_bytes: int. The model's and optimizer's variables.
    """
    traced = per_sample_bytes(model, inputs)
    if traced is None:
        return None
    forward, _, convolution = traced
    trainable = sum(
        int(np.prod(v.shape, dtype=np.int64))
        * tf.as_dtype(keras.backend.standardize_dtype(v.dtype)).size
        for v in model.trainable_variables
    )
    sample_input = sum(
        int(np.prod(x.shape[1:], dtype=np.int64)) * tf.as_dtype(x.dtype).size
        for x in keras.tree.flatten(inputs)
    )
    per_sample = _PER_SAMPLE_COPIES * forward + _INPUT_BATCHES * sample_input
    fixed = state_bytes + _STATE_COPIES * trainable
    if convolution:
        fixed += _CONVOLUTION_BUFFERS
    return int(fixed), int(per_sample)


def _shape(shape, batch_size, length):
    shape = list(shape)
    shape[0] = batch_size
    if length is not None and len(shape) >= 2:
        shape[1] = length
    return shape
