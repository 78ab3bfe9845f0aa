"""Tests for the user's data at any batch size (`_sources.py`).

Most of what a source answers is tested through `fit`, `evaluate` and
the estimates that use it; here, what is cheaper to see directly.
"""

import tensorflow as tf

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


if __name__ == "__main__":
    tf.test.main()
