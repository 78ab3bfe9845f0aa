"""Work run in fresh processes that import tfmemsafe before TensorFlow.

Kept apart from runtime_children, which imports Keras (and so TensorFlow)
at its top: here nothing is imported before the function runs.
"""


def out_of_memory_lines(tensorflow_first=False):
    """Runs one real allocator OOM; counts the lines it wrote to stderr."""
    import os
    import tempfile

    if tensorflow_first:
        import tensorflow  # noqa: F401

    import tfmemsafe  # isort: skip  (before TensorFlow, the point)
    import tensorflow as tf  # isort: skip

    log = tempfile.TemporaryFile("w+b")
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        with tfmemsafe.testing.AllocatorFailures() as failures:
            try:
                # 400 MB, in a process capped well below it.
                tf.zeros([100_000_000]) + 1.0
            except tf.errors.ResourceExhaustedError:
                pass
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    log.seek(0)
    text = log.read().decode(errors="replace")
    return {
        "lines": len(text.splitlines()),
        "allocator_failures": failures.count,
        "tensorflow_logs": tfmemsafe.runtime_config().tensorflow_logs,
        "onednn": tfmemsafe.runtime_config().onednn,
    }
