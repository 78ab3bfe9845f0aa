"""What a run of `SplitBatchOnOOM` records: `RunRecord`.

Where the run is (epoch, step, inside a `fit` or not), the errors it
recovered from, waiting for the attempt after them to say how many
micro-batches the batch ran as, and the `OOMEvent`s and `GrowBackEvent`s;
with the one line each logs and the messages `OutOfMemoryError` gives.
"""

from __future__ import annotations

from absl import logging

from tfmemsafe._messages import OOM_ADVICE
from tfmemsafe._messages import error_line
from tfmemsafe._messages import mib
from tfmemsafe.errors import OutOfMemoryError
from tfmemsafe.history import GrowBackEvent
from tfmemsafe.history import OOMEvent
from tfmemsafe.recovery._exact_split import after_an_oom


class RunRecord:
    """The events of one run, and where it is."""

    def __init__(self):
        self.oom_events = []
        self.grow_back_events = []
        # Set by `SplitBatchOnOOM` from Keras' hooks.
        self.epoch = self.step = None
        self.in_fit = False
        self.errors = 0  # Errors recovered from.
        # Errors waiting for the next attempt's micro-batch count.
        self._pending = []
        # Phases whose preset micro-batches were not used, said once.
        self._whole = set()

    def phase(self, name: str) -> str:
        """The phase a step function (`"train"`, `"test"`, `"predict"`)
        runs, in `OOMEvent`'s words."""
        if name == "train":
            return "training"
        if name == "test":
            return "validation" if self.in_fit else "evaluation"
        return "prediction"

    def ran_out(
        self, name, err, rows, smaller, probe, accumulation_steps, one_update
    ):
        """Logs an error recovered from, whose event waits for `settle`;
        `one_update`: whether a training batch's micro-batches make one
        update (not with a model's own `train_step`)."""
        self.errors += 1
        pending = dict(
            epoch=self.epoch or 0,
            step=self.step or 0,
            phase=self.phase(name),
            batch_size_before=rows,
            batch_size_after=rows,
            accumulation_steps=accumulation_steps,
            error=error_line(err),
            resumed_at_step=self.step,
            one_update=one_update,
        )
        self._pending.append(pending)
        logging.warning(
            "Out of memory, epoch %d, %s step %d: the batch of %d runs again "
            "as micro-batches of %s%s.",
            pending["epoch"] + 1,
            pending["phase"],
            pending["step"],
            rows,
            f"{smaller} rows"
            if probe is None
            else f"a size measured on a first one of {probe} rows",
            _updates(name, one_update),
        )

    def settle(self, pieces: int) -> None:
        """Records the waiting errors' events: the attempt after them ran
        (or planned) `pieces` micro-batches."""
        for pending in self._pending:
            self.oom_events.append(OOMEvent(**pending, split_into=pieces))
        self._pending = []

    def not_split_from_the_start(self, name, rows: int, refusal: str):
        """Logs, once a phase, that micro-batches asked for from the start
        are not used: the batches cannot be split exactly (`refusal`)."""
        if name in self._whole:
            return
        self._whole.add(name)
        logging.warning(
            "Micro-batches of %d rows were asked for from the first %s step "
            "(`micro_batch_size`, which tfmemsafe.fit's pre-flight check and "
            "a MemoryPlan set), and this model's batches are not split: "
            "%s, so their sum would not be the batch's. Whole batches are "
            "trained; %s.",
            rows,
            self.phase(name),
            refusal,
            after_an_oom(refusal),
        )

    def grew_back(self, name, before, after, in_use, accumulation_steps):
        held = "unknown" if in_use is None else mib(in_use)
        event = GrowBackEvent(
            epoch=self.epoch or 0,
            step=self.step or 0,
            batch_size_before=before,
            batch_size_after=after,
            accumulation_steps=accumulation_steps,
            predicted=f"{held} in use before the step",
        )
        self.grow_back_events.append(event)
        logging.info(
            "%s micro-batches grew back from %d to %d rows (%s).",
            self.phase(name).capitalize(),
            before,
            after,
            event.predicted,
        )


def _updates(name: str, one_update: bool) -> str:
    if name != "train":
        return ""
    return ", for one update" if one_update else ", each its own update"


def one_example(rows: int, err, floor: int = 1) -> str:
    """The message of a batch that runs out even in micro-batches of the
    fewest rows allowed (`floor`)."""
    smallest = (
        "one example" if floor == 1 else f"{floor} rows (the smallest allowed)"
    )
    return (
        f"A batch of {rows} ran out of memory even as micro-batches of "
        f"{smallest}. {OOM_ADVICE} The error: {error_line(err)}"
    )


def in_the_update(rows: int, err) -> str:
    """The message of a batch whose update itself ran out."""
    return (
        f"Out of memory inside the update of a batch of {rows} (every "
        "gradient existed; the optimizer had begun to change the weights, "
        "so they may be partly updated). The step is not retried. Instead, "
        "restart from the last checkpoint (`keras.callbacks.BackupAndRestore`) "
        f"with a smaller batch or more free memory. The error: "
        f"{error_line(err)}"
    )


def not_split(rows: int, refusal: str, err) -> str:
    """The message of a batch that cannot be split exactly (`refusal`)."""
    return (
        f"A batch of {rows} ran out of memory and is not split into "
        f"micro-batches: {refusal}, so their sum would not be the batch's. "
        f"Instead, use a smaller `batch_size`. The error: {error_line(err)}"
    )


def retries_used_up(rows: int, max_retries: int, err) -> str:
    return (
        f"A batch of {rows} ran out of memory, and the "
        f"`max_retries={max_retries}` errors to recover from are used up. "
        f"The error: {error_line(err)}"
    )


def given_up(message: str, rows: int) -> OutOfMemoryError:
    """The error that ends recovery from a batch of `rows`."""
    return OutOfMemoryError(message, tried_batch_sizes=(rows,))
