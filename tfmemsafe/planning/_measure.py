"""Training the candidates of a plan for a few steps: `measure` one,
`measured` in order until one trains.

The steps train the model's own variables, which are put back exactly
afterwards; the candidate comes back with its median step time and peak,
or a note of what stopped it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import keras

from tfmemsafe import memory
from tfmemsafe._model_state import ModelState
from tfmemsafe._sample_batch import without_sample_batch
from tfmemsafe.errors import OutOfMemoryError
from tfmemsafe.planning._memory_plan import Candidate
from tfmemsafe.recovery import SplitBatchOnOOM

# What a candidate says when fewer micro-batches of its model trained.
NOT_MEASURED = "not measured: fewer micro-batches trained"


def measure(
    planned, candidate, source, rows, steps, devices, limit, split_batch_norm
) -> Candidate:
    """Trains `steps + 1` batches as `candidate` says, on the model's own
    variables, and puts the model back."""
    split = SplitBatchOnOOM(
        grow_back_after=None,
        split_batch_norm=split_batch_norm,
        micro_batch_size=(
            candidate.micro_batch_size if candidate.micro_batches > 1 else None
        ),
    )
    times = _StepTimes()
    state = ModelState(planned)
    for device in devices:
        memory.reset_peak_memory(device)
    try:
        failed = _trained(planned, candidate, source, rows, steps, times, split)
    finally:
        # After an out-of-memory error and its frames (which hold the
        # step's tensors) are gone: putting the values back needs memory.
        state.restore()
        state.close()
    if failed:
        return dataclasses.replace(candidate, note=failed)
    if split.oom_events:
        return dataclasses.replace(
            candidate,
            note="ran out of memory; split into "
            f"{split.oom_events[-1].split_into}",
        )
    peaks = [memory.memory_info(d).peak_bytes for d in devices]
    peak = None if None in peaks else max(peaks)
    if peak is not None and limit and not memory.fits_within(peak, limit):
        # Measured beats predicted: it trained, but not within the limit.
        return dataclasses.replace(
            candidate,
            measured_peak_bytes=peak,
            note="measured over 90% of the limit",
        )
    # Keras calls the batch callbacks once per execution of
    # `steps_per_execution` steps; the first traces.
    return dataclasses.replace(
        candidate,
        measured_peak_bytes=peak,
        step_seconds=statistics.median(times.seconds[1:])
        / _steps_per_call(planned),
    )


def measured(candidates, measure_one) -> list[Candidate]:
    """`candidates`, those predicted to fit measured by `measure_one` in
    order until one trains within the limit: more micro-batches than that
    one are slower by their steps' fixed costs and are not measured."""
    done = []
    for candidate in candidates:
        if candidate.fits is False:
            done.append(
                dataclasses.replace(candidate, note="predicted not to fit")
            )
        elif any(c.trained for c in done):
            done.append(dataclasses.replace(candidate, note=NOT_MEASURED))
        else:
            done.append(measure_one(candidate))
    return done


def _trained(planned, candidate, source, rows, steps, times, split) -> str:
    """Trains the measured steps; `""`, or what stopped them."""
    try:
        # As `tfmemsafe.fit` trains: Keras reads no batch only to drop it.
        with without_sample_batch(planned):
            planned.fit(
                **source.trial_arguments(
                    rows, (steps + 1) * _steps_per_call(planned)
                ),
                epochs=1,
                verbose=0,
                callbacks=[times, split],
            )
    except OutOfMemoryError as err:
        return f"ran out of memory ({err.args[0]:.60})"
    except (ValueError, TypeError) as err:
        if not candidate.checkpointing:
            raise
        # What the wrapping refuses (a block with TensorFlow's stateful
        # random ops): the model as it is still trains.
        return f"failed: {err}"[:120]
    return ""


def _steps_per_call(model) -> int:
    return max(1, int(getattr(model, "steps_per_execution", 1) or 1))


class _StepTimes(keras.callbacks.Callback):
    """Each training step's wall time, in seconds."""

    def on_train_begin(self, logs=None):
        self.seconds = []

    def on_train_batch_begin(self, batch, logs=None):
        self._began = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.seconds.append(time.perf_counter() - self._began)
