"""The custom gradient that recomputes a call in the backward pass."""

from __future__ import annotations

import tensorflow as tf

from tfmemsafe import _compat


def checkpoint(function, args, recompute):
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
        paused = _compat.stop_recording() if recompute else None
        if paused is not None:
            with paused:
                results = function(*inputs)
        else:  # Kept as usual (also where tapes cannot be paused).
            recording = tf.GradientTape(persistent=True)
            with recording:
                recording.watch(inputs)
                results = function(*inputs)

        def backward(*output_gradients, variables=None):
            variables = list(variables or [])
            sources = list(inputs)
            if paused is not None:
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
