"""Tests for the user's data at any batch size (`_sources.py`).

Most of what a source answers is tested through `fit`, `evaluate` and
the estimates that use it; here, what is cheaper to see directly.
"""

import numpy as np
import scipy.sparse
import tensorflow as tf

import tfmemsafe
from tfmemsafe import estimate as estimate_lib
from tfmemsafe._arrays import tensor_bytes as _tensor_bytes
from tfmemsafe._sources import source_for


class SampleInputsTest(tf.test.TestCase):
    def test_a_shuffled_pipeline_is_read_once_for_its_sample(self):
        reads = tf.Variable(0)

        def counted(x):
            reads.assign_add(1)
            return x, x

        data = tf.data.Dataset.range(100).shuffle(100).map(counted)
        source = source_for(data, "x", labelled=True)
        first = source.sample_inputs()
        read = int(reads.numpy())
        self.assertIs(source.sample_inputs(), first)
        self.assertEqual(int(reads.numpy()), read)
        self.assertEqual(first.shape, (1,))


class NumSamplesTest(tf.test.TestCase):
    """The samples of an epoch, read from the pipeline where it tells
    them: what bounds `batch_size="auto"` and a plan's batch."""

    def test_a_batched_dataset_tells_the_samples_an_epoch_trains(self):
        cases = [
            (tf.data.Dataset.range(100).batch(30), 100),
            # The remainder `drop_remainder` drops is not trained.
            (tf.data.Dataset.range(100).batch(30, drop_remainder=True), 90),
            # A `filter` after the batching hides them.
            (tf.data.Dataset.range(100).batch(30).filter(lambda b: True), None),
            (tf.data.Dataset.range(100).repeat().batch(30), None),
        ]
        for data, samples in cases:
            source = source_for(
                (data.map(lambda b: (b, b))), "x", labelled=True
            )
            self.assertEqual(source.num_samples, samples, msg=str(data))

    def test_rebatched_batches_keep_their_length(self):
        data = tf.data.Dataset.range(100).batch(30, drop_remainder=True)
        source = source_for(data.map(lambda b: (b, b)), "x", labelled=True)
        rebatched = source.dataset(25)
        self.assertEqual(int(rebatched.cardinality()), 4)
        rows = [int(tf.shape(b[0])[0]) for b in rebatched]
        self.assertEqual(rows, [25, 25, 25, 15])


class ResidentBytesTest(tf.test.TestCase):
    """What arrays keep in memory through a run, and what they hold now:
    an estimate's line counts the first, what is held leaves out the
    second, so that the data is counted once whether converted yet or
    not."""

    def test_arrays_count_as_converted_and_hold_nothing_before(self):
        x = np.ones((1000, 256), "float64")  # Converted at floatx.
        y = np.zeros(1000, "int32")
        source = source_for((x, y), "x", labelled=True)
        converted = 1000 * 256 * 4 + 1000 * 4
        self.assertEqual(source.resident_bytes(), converted)
        self.assertEqual(source.resident_bytes_now(), 0)
        self.assertEqual(estimate_lib.data_held_on("CPU:0", source), 0)
        source.tensors()
        # The cast copy is the allocator's; what was added is measured.
        self.assertEqual(source.resident_bytes_now(), source.resident_bytes())
        if tfmemsafe.memory_info("CPU:0").current_bytes is not None:
            self.assertBetween(
                source.resident_bytes(), 1000 * 256 * 4, 2 * converted
            )

    def test_only_a_host_device_holds_the_data(self):
        source = source_for(
            (np.ones((64, 8), "float32"), np.zeros(64)), "x", labelled=True
        )
        source.tensors()
        self.assertEqual(estimate_lib.data_on("GPU:0", source), 0)
        self.assertEqual(estimate_lib.data_held_on("GPU:0", source), 0)
        self.assertEqual(
            estimate_lib.data_on("CPU:0", source), source.resident_bytes()
        )

    def test_a_pipeline_holds_nothing(self):
        data = tf.data.Dataset.from_tensor_slices((tf.ones((8, 2)), tf.ones(8)))
        source = source_for(data.batch(4), "x", labelled=True)
        self.assertEqual(source.resident_bytes(), 0)
        self.assertEqual(source.resident_bytes_now(), 0)

    def test_sparse_leaves_count_their_values_and_indices(self):
        matrix = scipy.sparse.random(
            1000, 500, density=0.01, format="csr", dtype="float32"
        )
        self.assertEqual(_tensor_bytes(matrix), matrix.nnz * (4 + 2 * 8))
        sparse = tf.sparse.from_dense(tf.eye(4))
        self.assertEqual(_tensor_bytes(sparse), 4 * 4 + 4 * 2 * 8)


if __name__ == "__main__":
    tf.test.main()
