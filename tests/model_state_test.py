"""Tests for tfmemsafe._model_state: a model's state on disk, put back.

The real-cap test that puts 63 MiB back with 4 MB free is in
recovery_test (`test_memory_held_for_good_gives_up_and_puts_the_state_back`).
`ReserveTest` puts a state back with less than a piece free.
"""

import os
from unittest import mock

import _models

# The CPU allocator keeps statistics only with BFC (or oneDNN) on; it must
# be chosen before TensorFlow is imported.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmemsafe  # noqa: E402
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
        # What `restore` does: each piece a tensor of its own.
        model = _conv_net()
        saved, snapshot = _saved_then_overwritten(model)
        largest = 0
        for path, pieces, layout in snapshot.copy.files:
            contents = tf.io.read_file(path)
            for piece, place in zip(pieces, layout, strict=True):
                value = _model_state._decode(contents, piece[0], place)
                size = value.dtype.size * value.shape.num_elements()
                largest = max(largest, size)
                _model_state._put(value, piece)
        snapshot.close()
        for variable, value in zip(_state(model), saved, strict=True):
            self.assertAllEqual(variable.numpy(), value)
        # The conv kernel and its moments are cut in pieces of 1 MiB.
        self.assertLessEqual(largest, _model_state._PIECE_BYTES)

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
        copy = _model_state._DiskCopy([(v, [v]) for v in variables])
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

        with mock.patch.object(_model_state.os, "open", refusing):
            copy = _model_state._DiskCopy([(variable, [variable])])
        variable.assign(tf.zeros(10))
        copy.restore()
        copy.close()
        self.assertAllEqual(variable.numpy(), np.arange(10))


def _filled():
    """Tensors of 1 MiB that take the allocator until one more cannot
    be had: less than a saved piece is left free."""
    held = []
    try:
        while True:
            held.append(tf.zeros((2**20 // 4,)))
    except tf.errors.ResourceExhaustedError:
        return held


def restore_with_nothing_free(reserve):
    """Puts a state back with the allocator full but for what a `Reserve`
    let go (with `reserve`): whether every value came back."""
    model = _conv_net()
    saved, snapshot = _saved_then_overwritten(model)
    kept = _model_state.Reserve(["CPU:0"])
    if reserve:
        kept.take()
    taken = bool(kept.tensors)
    held = _filled()
    kept.release()
    try:
        snapshot.restore()
    except tf.errors.ResourceExhaustedError:
        return {"taken": taken, "restored": False}
    del held  # Reading a variable back to compare it needs a copy.
    restored = all(
        np.array_equal(variable.numpy(), value)
        for variable, value in zip(_state(model), saved, strict=True)
    )
    return {"taken": taken, "restored": restored}


class ReserveTest(tf.test.TestCase):
    """Under a real cap, with everything else taken by other tensors."""

    def test_a_reserve_lets_the_state_back_with_the_allocator_full(self):
        with_reserve, without = _models.side_by_side(
            restore_with_nothing_free, [[True], [False]], cap_mb=120
        )
        self.assertTrue(with_reserve["taken"], msg=with_reserve)
        self.assertTrue(with_reserve["restored"], msg=with_reserve)
        # Without it, not one 1 MiB piece could be read back.
        self.assertFalse(without["restored"], msg=without)

    def test_no_reserve_is_taken_where_there_is_no_room(self):
        kept = _model_state.Reserve(["CPU:0"])
        with mock.patch.object(
            _model_state.memory,
            "memory_info",
            return_value=tfmemsafe.MemoryInfo("CPU:0", 100, 100, 101),
        ):
            kept.take()
        self.assertEqual(kept.tensors, {})
        kept.take()  # Room now (the real allocator's statistics).
        self.assertLen(kept.tensors, 1)
        kept.release()
        self.assertEqual(kept.tensors, {})


if __name__ == "__main__":
    tf.test.main()
