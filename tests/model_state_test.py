"""Tests for tfmemsafe._model_state and _disk_copy: a model's state on
disk, put back."""

import os
from unittest import mock

# The CPU allocator keeps statistics only with BFC (or oneDNN) on; it must
# be chosen before TensorFlow is imported.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmemsafe import _disk_copy  # noqa: E402
from tfmemsafe import _model_state  # noqa: E402


def _conv_net():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4, 4, 512)),
            # A kernel of 9 MiB: each of its first axis' three rows holds
            # 3 MiB, each (i, j) of its first two axes 1 MiB.
            keras.layers.Conv2D(512, 3, padding="same"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    model.compile("adam", "sparse_categorical_crossentropy")
    x = np.random.default_rng(0).normal(size=(8, 4, 4, 512)).astype("float32")
    model.fit(x, np.arange(8) % 10, epochs=1, verbose=0)
    return model


def _state(model):
    return model.variables + model.optimizer.variables


def _saved_then_overwritten(model):
    """The model's values, and a `ModelState` of them; then overwrites them."""
    saved = [v.numpy() for v in _state(model)]
    snapshot = _model_state.ModelState(model)
    for variable in _state(model):
        variable.assign(tf.ones_like(variable))
    return saved, snapshot


class ModelStateTest(tf.test.TestCase):
    def test_puts_back_every_value_exactly(self):
        model = _conv_net()
        saved, snapshot = _saved_then_overwritten(model)
        snapshot.restore()
        snapshot.close()
        for variable, value in zip(_state(model), saved, strict=True):
            self.assertAllEqual(variable.numpy(), value)

    def test_pieces_read_one_at_a_time_put_back_every_value(self):
        # What `restore` does: each piece a tensor of its own.
        model = _conv_net()
        saved, snapshot = _saved_then_overwritten(model)
        largest = 0
        for path, pieces, layout in snapshot.copy.files:
            contents = tf.io.read_file(path)
            for piece, place in zip(pieces, layout, strict=True):
                value = _disk_copy._decode(contents, piece[0], place)
                size = value.dtype.size * value.shape.num_elements()
                largest = max(largest, size)
                _disk_copy._put(value, piece)
        snapshot.close()
        for variable, value in zip(_state(model), saved, strict=True):
            self.assertAllEqual(variable.numpy(), value)
        # The conv kernel and its moments are cut in pieces of 1 MiB.
        self.assertLessEqual(largest, _disk_copy._PIECE_BYTES)

    def test_every_kind_of_value_comes_back(self):
        # Types `decode_raw` makes, one it does not (through bytes), and
        # strings (through `SaveV2`); whole and in pieces.
        values = [
            np.arange(3 * 2**18, dtype="float32").reshape(3, 2**18),
            np.array([2**32 - 1, 7], dtype="uint32"),
            np.array([2**63 - 1], dtype="uint64"),
            np.array([True, False, True]),
            np.array(3.5, dtype="float16"),
            np.array([b"a", b"bc"]),
        ]
        variables = [tf.Variable(value) for value in values]
        copy = _disk_copy.DiskCopy([(v, [v]) for v in variables])
        for variable in variables:
            variable.assign(tf.zeros_like(variable))
        copy.restore()
        copy.close()
        self.assertFalse(os.path.exists(copy.directory))
        for variable, value in zip(variables, values, strict=True):
            self.assertAllEqual(variable.numpy(), value)
        kinds = [layout is None for _, _, layout in copy.files]
        self.assertEqual(sorted(kinds), [False, True])

    def test_a_file_system_without_direct_writes_gets_buffered_ones(self):
        variable = tf.Variable(np.arange(10, dtype="float32"))
        real_open = os.open

        def refusing(path, flags, *args):
            if flags & getattr(os, "O_DIRECT", 0):
                raise OSError(22, "Invalid argument")
            return real_open(path, flags, *args)

        with mock.patch.object(_disk_copy.os, "open", refusing):
            copy = _disk_copy.DiskCopy([(variable, [variable])])
        variable.assign(tf.zeros(10))
        copy.restore()
        copy.close()
        self.assertAllEqual(variable.numpy(), np.arange(10))


if __name__ == "__main__":
    tf.test.main()
