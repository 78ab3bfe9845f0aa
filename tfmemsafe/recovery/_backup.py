"""The batch size a stopped multi-worker job goes on with, kept with its backup.

A `MultiWorkerMirroredStrategy` job cannot halve its batch on one worker
while the others wait in the same collective: after an out-of-memory error
every worker stops (`distribute.stop_all_workers`). Before that, each
worker writes the decision (the halved batch size, the doubled
accumulation steps) next to the `BackupAndRestore` backup. Restarting the
same command on every worker then resumes from the backup at the smaller
size, with no flag changed. `BackupAndRestore` deletes the file with its
backup at the end of training.
"""

from __future__ import annotations

import json
import os

import keras
from absl import logging

from tfmemsafe import distribute
from tfmemsafe.errors import OutOfMemoryError
from tfmemsafe.recovery._policy import accumulation_steps_of

_FILE = "tfmemsafe_batch_size.json"


class Decisions:
    """The decision files in the backup directories of `callbacks`.

    Attributes:
        directories: list of str. The `backup_dir` of every
            `keras.callbacks.BackupAndRestore` among the callbacks.
        loaded: bool. Whether `load` found a decision and applied it.
    """

    def __init__(self, callbacks):
        self.directories = [
            c.backup_dir
            for c in callbacks
            if isinstance(c, keras.callbacks.BackupAndRestore)
        ]
        self.loaded = False

    def store(self, sizes, accumulation_steps: int | None) -> None:
        """Writes the sizes tried and the accumulation steps to go on with.

        Every worker writes the same content, atomically, so it is there
        whichever worker learnt of the error.
        """
        decision = {
            "requested_batch_size": sizes.requested,
            "tried": sizes.tried,
            "accumulation_steps": accumulation_steps,
        }
        for directory in self.directories:
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, _FILE)
            temporary = f"{path}.{distribute.worker_index()}.tmp"
            with open(temporary, "w") as f:
                json.dump(decision, f)
            os.replace(temporary, path)

    def stop_all_workers(
        self, err, strategy, sizes, model, *, halve
    ) -> OutOfMemoryError:
        """Stores the smaller training size with the backup; the error
        that stops every worker of the job (see `distribute`).

        Args:
            err: The out-of-memory error.
            strategy: The multi-worker strategy.
            sizes: The training `Halving`.
            model: The model, whose `accumulation_steps` is stored.
            halve: Callable that halves the training batch (raising
                OutOfMemoryError when it cannot), or `None` when the error
                was not in training: nothing to store then.
        """
        before = sizes.batch_size
        after = None
        if self.directories and halve is not None:
            try:
                halve()
            except OutOfMemoryError:
                pass  # Nothing smaller to store: stop all the same.
            else:
                after = sizes.batch_size
                self.store(sizes, accumulation_steps_of(model))
        return distribute.stop_all_workers(
            err, before, strategy, resume_batch_size=after
        )

    def load(self, sizes, model) -> None:
        """Goes on at the size a stopped job stored, if it asked the same.

        Args:
            sizes: The training `Halving`; its sizes become those tried.
            model: The model, whose `accumulation_steps` is set.
        """
        for directory in self.directories:
            path = os.path.join(directory, _FILE)
            if not os.path.exists(path):
                continue
            with open(path) as f:
                decision = json.load(f)
            if decision["requested_batch_size"] != sizes.requested:
                logging.warning(
                    "tfmemsafe.fit: ignoring the batch size stored in %s, "
                    "decided for batch_size=%d: this run asks for %d.",
                    path,
                    decision["requested_batch_size"],
                    sizes.requested,
                )
                return
            sizes.tried = list(decision["tried"])
            steps = decision["accumulation_steps"]
            if steps is not None and accumulation_steps_of(model):
                model.accumulation_steps = steps
            self.loaded = True
            logging.warning(
                "tfmemsafe.fit: resuming at batch size %d%s, as stored in %s "
                "after running out of memory at %d.",
                sizes.batch_size,
                "" if steps is None else f" x {steps} accumulation steps",
                path,
                sizes.tried[-2],
            )
            return
