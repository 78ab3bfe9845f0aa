"""Training on several workers: who is who, backups, and stopping on OOM.

`is_multi_worker`, `worker_index` and `is_chief` tell a process its place
in a `MultiWorkerMirroredStrategy` cluster; `MultiWorkerBackupAndRestore`
backs up from the chief only; `stop_all_workers` stops every worker when
one runs out of memory. A plain Keras 3 model cannot be fit under that
strategy at all; `tfmemsafe.AccumulatingModel` can (see
`tfmemsafe/accumulation/_multi_worker.py` for why and how).
"""

from __future__ import annotations

import keras
import tensorflow as tf
from absl import logging

from tfmemsafe import _compat
from tfmemsafe import _messages
from tfmemsafe.errors import OutOfMemoryError


def is_multi_worker(strategy: tf.distribute.Strategy | None = None) -> bool:
    """Whether a strategy spans more than one worker process.

    Args:
        strategy: The strategy to ask about. Defaults to `None`, the
            strategy in scope.

    Returns:
        `True` for a `MultiWorkerMirroredStrategy` whose cluster has more
        than one worker.
    """
    strategy = strategy or tf.distribute.get_strategy()
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return False
    # The strategy knows once it has read the cluster from TF_CONFIG.
    return _compat.in_multi_worker_mode(strategy)


def worker_index(strategy: tf.distribute.Strategy | None = None) -> int:
    """This process's task index in a multi-worker cluster (0 elsewhere)."""
    strategy = strategy or tf.distribute.get_strategy()
    if not is_multi_worker(strategy):
        return 0
    return int(strategy.cluster_resolver.task_id)


def is_chief(strategy: tf.distribute.Strategy | None = None) -> bool:
    """Whether this process should write shared outputs (worker 0)."""
    return worker_index(strategy) == 0


class MultiWorkerBackupAndRestore(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` for several workers.

    Keras 3's callback has every worker write the same backup files at
    once. This one lets only the chief (worker 0) write, and every worker
    restore from the chief's files, which therefore must be on a file
    system that every worker can read (as Keras 2 required). On one
    machine it is `keras.callbacks.BackupAndRestore`.

    After a job fails, for example because one worker ran out of memory,
    start every worker again with the same `backup_dir`: training resumes
    after the last epoch the chief backed up.

    Args:
        backup_dir: str. A directory every worker can read. Other
            arguments as for `keras.callbacks.BackupAndRestore`.
    """

    def _save_model(self):
        if is_chief(self.model.distribute_strategy):
            super()._save_model()

    def on_train_end(self, logs=None):
        # The chief deletes the backup it wrote.
        if is_chief(self.model.distribute_strategy):
            super().on_train_end(logs)


def stop_all_workers(
    err: BaseException, batch_size: int, strategy=None
) -> OutOfMemoryError:
    """Stops the whole job after one worker ran out of memory, in your own
    training loop.

    A multi-worker job cannot halve its batch on one worker alone: the
    other workers are waiting for it in the same collective and would wait
    until their timeouts (or forever). So the worker that ran out reports
    it to the cluster's coordination service, which fails every worker's
    pending collective at once with the same message, and each worker
    raises the returned error. (`tfmemsafe.fit` and `SplitBatchOnOOM`
    need none of this: every worker learns of an error in the same step
    and splits the batch alike.)

    Args:
        err: The out-of-memory error: this worker's own, or the one another
            worker reported.
        batch_size: The global batch size that did not fit.
        strategy: The job's strategy. Defaults to the one in scope.

    Returns:
        A `tfmemsafe.OutOfMemoryError` to raise from `err`, saying which
        worker ran out and how to restart the job.
    """
    for line in str(err).splitlines():
        if _STOPPED in line:
            # Another worker's report: pass its words on.
            reported = line[line.index(_STOPPED) :]
            return OutOfMemoryError(reported, (batch_size,))
    strategy = strategy or tf.distribute.get_strategy()
    workers = _compat.num_workers(strategy)
    message = (
        f"{_STOPPED} {worker_index(strategy)} of {workers} at global batch "
        f"size {batch_size}. A multi-worker job cannot halve its batch on "
        "one worker while the others wait in the same collective, so every "
        "worker has been stopped. Restart all workers with a smaller batch "
        f"size (for example {max(batch_size // 2, workers)}); with "
        "`tfmemsafe.distribute.MultiWorkerBackupAndRestore(backup_dir)` "
        "among the callbacks, training resumes after the last completed "
        f"epoch. {_messages.OOM_ADVICE}"
    )
    try:
        _compat.report_error_to_cluster(tf.errors.RESOURCE_EXHAUSTED, message)
    except (tf.errors.OpError, ValueError, RuntimeError) as report_error:
        # No coordination service: the others learn of it from the
        # missing heartbeats instead, within about a minute.
        logging.warning(
            "Could not report the OOM to the other workers: %s", report_error
        )
    return OutOfMemoryError(message, (batch_size,))


_STOPPED = "Out of memory on worker"
