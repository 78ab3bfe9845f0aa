"""Tests for the message text the library shares (`_messages.py`)."""

import tensorflow as tf

from tfmemsafe import _messages


class ErrorLineTest(tf.test.TestCase):
    def test_the_line_that_says_what_ran_out(self):
        for text, line in (
            (
                "Graph execution error:\n\nOOM when allocating tensor\n",
                "OOM when allocating tensor",
            ),
            (
                "Graph execution error:\nFailed to allocate request for "
                "1.00GiB on device ordinal 0",
                "Failed to allocate request for 1.00GiB on device ordinal 0",
            ),
            (
                "Out of Memory while trying to allocate",
                "Out of Memory while trying to allocate",
            ),
            ("Something else\nand more", "Something else"),
        ):
            error = tf.errors.ResourceExhaustedError(None, None, text)
            self.assertEqual(_messages.error_line(error), line)

    def test_keras_bold_and_quoted_traceback_lines_are_left_out(self):
        text = (
            'File "train.py", line 9, in fit_in_memory\n'
            "\x1b[1mOOM when allocating tensor\x1b[0m"
        )
        self.assertEqual(
            _messages.error_line(text), "OOM when allocating tensor"
        )


if __name__ == "__main__":
    tf.test.main()
