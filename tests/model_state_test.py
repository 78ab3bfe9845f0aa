"""Tests for tfmemsafe._model_state: a model's state on disk, put back.

The real-cap test that puts 63 MiB back with 4 MB free is in
recovery_test (`test_memory_held_for_good_gives_up_and_puts_the_state_back`).
"""

import keras
import numpy as np
import tensorflow as tf

from tfmemsafe import _model_state


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
    """The model's values, and a `Snapshot` of them; then overwrites them."""
    saved = [v.numpy() for v in _state(model)]
    snapshot = _model_state.Snapshot(model)
    for variable in _state(model):
        variable.assign(tf.ones_like(variable))
    return saved, snapshot


class SnapshotTest(tf.test.TestCase):
    def test_puts_back_every_value_exactly(self):
        model = _conv_net()
        saved, snapshot = _saved_then_overwritten(model)
        snapshot.restore()
        snapshot.close()
        for variable, value in zip(_state(model), saved, strict=True):
            self.assertAllEqual(variable.numpy(), value)

    def test_pieces_read_one_at_a_time_put_back_every_value(self):
        # What `restore` does when a file's pieces cannot be read at once.
        model = _conv_net()
        saved, snapshot = _saved_then_overwritten(model)
        largest = 0
        for path, pieces in snapshot.copy.files:
            for index, piece in enumerate(pieces):
                (value,) = _model_state._read(path, [index], [piece])
                size = value.dtype.size * value.shape.num_elements()
                largest = max(largest, size)
                _model_state._put(value, piece)
        snapshot.close()
        for variable, value in zip(_state(model), saved, strict=True):
            self.assertAllEqual(variable.numpy(), value)
        # The conv kernel and its moments are cut in pieces of 1 MiB.
        self.assertLessEqual(largest, _model_state._PIECE_BYTES)


if __name__ == "__main__":
    tf.test.main()
