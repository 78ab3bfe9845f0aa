"""The batch size a stopped multi-worker job goes on with, kept with its backup.

A `MultiWorkerMirroredStrategy` job cannot halve its batch on one worker
while the others wait in the same collective: after an out-of-memory error
every worker stops (`distribute.stop_all_workers`). Before that, each
worker writes the size policy's decision (the halved batch size, the doubled
accumulation steps) next to the `BackupAndRestore` backup. Restarting the
same command on every worker then resumes from the backup at the smaller
size, with no flag changed. `BackupAndRestore` deletes the file with its
backup at the end of training.

A job whose batch sizes are a memory plan (`batch_size="auto"` on
examples of varying length) plans its buckets again when restarted, and
the new plan's first size may differ from the old one's by a few
samples: its decision is stored as `"auto"`, and applies to the new plan
in proportion (half the first bucket's batch stays half).
"""

from __future__ import annotations

import json
import os

import keras
from absl import logging

from tfmemsafe import distribute
from tfmemsafe.errors import OutOfMemoryError

_FILE = "tfmemsafe_batch_size.json"
# What a memory plan's decision was asked for.
_AUTO = "auto"


class Decisions:
    """The decision files in the backup directories of `callbacks`.

    Attributes:
        directories: list of str. The `backup_dir` of every
            `keras.callbacks.BackupAndRestore` among the callbacks.
        planned: bool. Whether the training sizes are a memory plan's,
            made again on a restart (`batch_size="auto"` on examples of
            varying length).
    """

    def __init__(self, callbacks, *, planned: bool = False):
        self.directories = [
            c.backup_dir
            for c in callbacks
            if isinstance(c, keras.callbacks.BackupAndRestore)
        ]
        self.planned = planned

    def store(self, requested: int, tried, accumulation_steps) -> None:
        """Writes the training sizes tried and the accumulation steps to go
        on with, for a job that asked for `requested`.

        Every worker writes the same content, atomically, so it is there
        whichever worker learnt of the error.
        """
        decision = {
            "requested_batch_size": _AUTO if self.planned else requested,
            "tried": list(tried),
            "accumulation_steps": accumulation_steps,
        }
        for directory in self.directories:
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, _FILE)
            temporary = f"{path}.{distribute.worker_index()}.tmp"
            with open(temporary, "w") as f:
                json.dump(decision, f)
            os.replace(temporary, path)

    def stop_all_workers(self, err, phase: str, policy, strategy):
        """Stores the smaller training size with the backup, and gives the
        error that stops every worker of the job (see `distribute`).

        Args:
            err: The out-of-memory error.
            phase: str. The phase that ran out.
            policy: The call's `SizePolicy`, asked for the smaller size.
            strategy: The multi-worker strategy.

        Returns:
            The error to raise, and the policy's `SizeDecision` that was
            stored (or `None`: nothing was, out of training or without a
            `BackupAndRestore`).
        """
        before = policy.batch_size(phase)
        decision = None
        if phase == "training" and self.directories:
            try:
                decision = policy.halve(phase, err)
            except OutOfMemoryError:
                pass  # Nothing smaller to store: stop all the same.
            else:
                self.store(
                    policy.requested(phase),
                    policy.tried(phase),
                    decision.accumulation_steps_after,
                )
        stop = distribute.stop_all_workers(
            err,
            before,
            strategy,
            resume_batch_size=None
            if decision is None
            else decision.batch_size_after,
        )
        return stop, decision

    def load(self, requested: int):
        """The sizes a stopped job stored, if it asked for `requested`
        (a memory plan's: for any first size, in proportion to
        `requested`, the new plan's).

        Returns:
            `(tried, accumulation_steps, path)`, or `None`.
        """
        for directory in self.directories:
            path = os.path.join(directory, _FILE)
            if not os.path.exists(path):
                continue
            with open(path) as f:
                decision = json.load(f)
            stored = decision["requested_batch_size"]
            asked = _AUTO if self.planned else requested
            if stored != asked:
                logging.warning(
                    "tfmemsafe.fit: ignoring the batch size stored in %s, "
                    "decided for batch_size=%s: this run asks for %s.",
                    path,
                    stored,
                    asked,
                )
                return None
            tried = decision["tried"]
            if self.planned:
                # The new plan's first size, and the stored ones in
                # proportion to it.
                tried = [requested] + [
                    max(1, round(size * requested / tried[0]))
                    for size in tried[1:]
                ]
            return tried, decision["accumulation_steps"], path
        return None
