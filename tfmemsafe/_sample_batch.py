"""Keeps Keras from reading a batch it does not need at each call.

Under a `tf.distribute` strategy, Keras 3's TensorFlow trainer starts
every `fit` and `evaluate` call by making an iterator of the data,
taking one batch from it and dropping the iterator
(`_maybe_symbolic_build`): the batch's shapes build the model, its
metrics and its loss. Once those are built, Keras reads the batch and
throws it away. tfmemsafe makes one call per epoch, and more after an
out-of-memory error and in each memory probe, so the waste adds up.
It also crashes: with the allocator full from an error a moment ago,
dropping that iterator while its `MultiDeviceIterator` is still
fetching ended the process with SIGSEGV
(`MultiDeviceBuffer::BackgroundThread` in `DatasetBaseIterator::GetNext`,
read with gdb; about one run in twenty of the held-memory
`MirroredStrategy` scenario in recovery_test).

`without_sample_batch(model)` skips that read while the model, its
compiled metrics and its compiled loss are all built, and changes
nothing otherwise: the model's own method still runs (it builds the
optimizer if needed). Keras has no public switch; this reads the same
private attributes Keras' `_symbolic_build` reads, and where they are
missing it lets Keras read the batch.
"""

from __future__ import annotations

import contextlib

from tfmemsafe import _compat

_METHOD = "_maybe_symbolic_build"


@contextlib.contextmanager
def without_sample_batch(model):
    """Calls of `model` inside skip Keras' sample batch once it is built.

    Scopes nest; each puts back what it found.
    """
    method = getattr(model, _METHOD, None)
    if not callable(method):
        yield
        return
    found = vars(model).get(_METHOD)

    def build(iterator=None, data_batch=None):
        if iterator is not None and _built(model):
            iterator = None
        return method(iterator=iterator, data_batch=data_batch)

    # Past Keras' attribute tracking: a function is not model state.
    object.__setattr__(model, _METHOD, build)
    try:
        yield
    finally:
        if found is None:
            object.__delattr__(model, _METHOD)
        else:
            object.__setattr__(model, _METHOD, found)


def _built(model) -> bool:
    """Whether Keras' `_symbolic_build` has nothing left to build from a
    batch (it builds an unbuilt optimizer without one)."""
    layers = [model, *_compat.nested_layers(model)]
    parts = _compat.compiled_loss_and_metrics(model)
    if not parts:
        return False
    return all(layer.built for layer in layers) and all(
        part is None or part.built for part in parts
    )
