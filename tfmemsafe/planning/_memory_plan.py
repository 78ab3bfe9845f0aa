"""What `tfmemsafe.plan` returns: `Candidate`s and the `MemoryPlan`."""

from __future__ import annotations

import dataclasses
import weakref

import keras

from tfmemsafe._messages import mib
from tfmemsafe.recovery import SplitBatchOnOOM

# `Candidate.predicted_by` of an upper bound from the traced step.
STATIC_BOUND = "static bound"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to train the batch, what was predicted and what was measured.

    Attributes:
        micro_batches: int. How many micro-batches the batch trains as
            (one update); `1` for the whole batch at once.
        micro_batch_size: int. The rows of each micro-batch (the last may
            hold fewer), of the global batch, as `batch_size` counts them.
        checkpointing: bool. Whether the model's blocks are recomputed in
            the backward pass (`tfmemsafe.Checkpointed`).
        predicted_peak_bytes: int or `None`. The step's predicted peak,
            beside what something else held when planning; `None` where
            no prediction could be made.
        predicted_by: str. `"estimate"` (`tfmemsafe.estimate_memory`),
            `"static bound"` (an upper bound from the traced step, under
            the limit), or why there is no prediction.
        fits: bool or `None`. Whether the prediction fits the limit with
            10% of it left free; `None` without a prediction.
        measured_peak_bytes: int or `None`. The peak measured while the
            candidate trained, where it trained and the device keeps
            statistics.
        step_seconds: float or `None`. The median time of a training step
            of the whole batch, where it was measured.
        note: str. Why it was not measured, or what happened when it was
            (`"ran out of memory"`, an error); `""` when it trained.
    """

    micro_batches: int
    micro_batch_size: int
    checkpointing: bool
    predicted_peak_bytes: int | None = None
    predicted_by: str = ""
    fits: bool | None = None
    measured_peak_bytes: int | None = None
    step_seconds: float | None = None
    note: str = ""

    @property
    def name(self) -> str:
        """`"4 x 128, checkpointed"`: how the batch trains."""
        name = f"{self.micro_batches} x {self.micro_batch_size}"
        return name + (", checkpointed" if self.checkpointing else "")

    @property
    def trained(self) -> bool:
        """Whether the candidate trained and its step was timed."""
        return self.step_seconds is not None

    def samples_per_second(self, batch_size: int) -> float | None:
        """Samples trained a second at `batch_size`, where measured."""
        if not self.step_seconds:
            return None
        return batch_size / self.step_seconds


class MemoryPlan:
    """How to train a batch in the memory there is, chosen by measurement.

    Made by `tfmemsafe.plan`. `print(plan)` shows every candidate it
    considered; `plan.apply(model)` gives the model to train and
    `plan.callback()` the callback that trains the chosen micro-batches
    (`tfmemsafe.fit(..., plan=plan)` does both).

    Attributes:
        batch_size: int. The batch the plan trains.
        device: str. The device whose memory was planned for.
        limit_bytes: int or `None`. The memory planned within.
        candidates: tuple of `Candidate`, in the order considered.
        chosen: `Candidate`. Of the measured candidates that trained
            without running out of memory, the simplest within 5% of the
            fastest; when none did, the one predicted to need the least
            memory (the run then splits its batches further as they run
            out).
        not_tried: tuple of str. What was not considered, and why.
        seconds: float. How long planning took.
        split_batch_norm: bool. As `plan` was called with; `callback()`
            passes it on.
        per_replica: int or `None`. On a multi-worker job, the rows of
            each replica's share of the batch, which each worker measured;
            `None` on one machine.
    """

    def __init__(
        self,
        model,
        checkpointed_model,
        *,
        batch_size,
        device,
        limit_bytes,
        candidates,
        chosen,
        not_tried,
        seconds,
        split_batch_norm=False,
        per_replica=None,
    ):
        self._model = weakref.ref(model)
        self._checkpointed_model = checkpointed_model
        self.batch_size = batch_size
        self.device = device
        self.limit_bytes = limit_bytes
        self.candidates = tuple(candidates)
        self.chosen = chosen
        self.not_tried = tuple(not_tried)
        self.seconds = seconds
        self.split_batch_norm = split_batch_norm
        self.per_replica = per_replica

    @property
    def micro_batch_size(self) -> int | None:
        """The chosen micro-batch rows, or `None` for whole batches."""
        if self.chosen.micro_batches == 1:
            return None
        return self.chosen.micro_batch_size

    def apply(self, model: keras.Model) -> keras.Model:
        """The model to train: `model`, or with checkpointing chosen, a
        model built from `model`'s own layers with its blocks recomputed.

        It shares every layer and variable with `model` and is compiled
        with `model`'s optimizer, loss and metrics: training it trains
        `model`. Save `model`, which has no `Checkpointed` wrappers.

        Raises:
            ValueError: If `model` is not the model the plan was made for,
                or the plan recomputes and `model` was compiled again
                since.
        """
        if model is not self._model():
            raise ValueError(
                "`model` must be the model the plan was made for. Received: "
                f"model={model.name!r}; the plan is for a model that "
                "`tfmemsafe.plan` was called with."
            )
        if not self.chosen.checkpointing:
            return model
        if self._checkpointed_model.optimizer is not model.optimizer:
            raise ValueError(
                "`model` was compiled again after the plan was made, and "
                "the checkpointed model the plan trains keeps the optimizer "
                "it had then. Make the plan again."
            )
        return self._checkpointed_model

    def callback(self, **kwargs) -> SplitBatchOnOOM:
        """A `tfmemsafe.SplitBatchOnOOM` that trains the chosen
        micro-batches from the first step (and splits further if they
        run out). `kwargs` go to it."""
        kwargs.setdefault("split_batch_norm", self.split_batch_norm)
        return SplitBatchOnOOM(micro_batch_size=self.micro_batch_size, **kwargs)

    def __str__(self) -> str:
        limit = "unknown" if self.limit_bytes is None else mib(self.limit_bytes)
        rows = [
            (
                "  candidate",
                "peak predicted",
                "fits",
                "peak measured",
                "step",
                "samples/s",
                "",
            )
        ]
        for candidate in self.candidates:
            rate = candidate.samples_per_second(self.batch_size)
            rows.append(
                (
                    ("* " if candidate is self.chosen else "  ")
                    + candidate.name,
                    _predicted(candidate),
                    {True: "yes", False: "no", None: "-"}[candidate.fits],
                    _or_dash(candidate.measured_peak_bytes, mib),
                    _or_dash(candidate.step_seconds, "{:.3f} s".format),
                    _or_dash(rate, "{:.1f}".format),
                    candidate.note,
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(6)]
        batch = f"batch {self.batch_size}"
        if self.per_replica is not None:
            batch += f" ({self.per_replica} on each replica)"
        lines = [
            f"MemoryPlan: {batch} on {self.device}, limit {limit} (90% "
            f"usable); planned in {self.seconds:.1f} s"
        ]
        for row in rows:
            cells = [row[i].ljust(widths[i]) for i in range(6)] + [row[6]]
            lines.append("  ".join(cells).rstrip())
        lines.append(f"* chosen: {self.chosen.name}")
        lines += [f"not tried: {why}" for why in self.not_tried]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"<MemoryPlan batch_size={self.batch_size} "
            f"chosen={self.chosen.name!r}>"
        )


def _predicted(candidate) -> str:
    if candidate.predicted_peak_bytes is None:
        return "-"
    by = " (bound)" if candidate.predicted_by == STATIC_BOUND else ""
    return mib(candidate.predicted_peak_bytes) + by


def _or_dash(value, form) -> str:
    return "-" if value is None else form(value)
