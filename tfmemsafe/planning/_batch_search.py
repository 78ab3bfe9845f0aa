"""`find_max_batch_size`: the largest batch that trains with memory to spare.

The search (`_search`) picks the sizes to try; each `_Trial` trains a few
steps at one size, reads the peak memory and puts the model back as it was.
"""

from __future__ import annotations

import keras
from absl import logging

from tfmemsafe import _checks
from tfmemsafe import _messages
from tfmemsafe import memory
from tfmemsafe._model_state import ModelState
from tfmemsafe._sources import DEFAULT_BATCH_SIZE
from tfmemsafe._sources import source_for
from tfmemsafe._unrecoverable import ModelUnusableError
from tfmemsafe.errors import OutOfMemoryError
from tfmemsafe.planning._retry import release
from tfmemsafe.planning._retry import retry_on_oom
from tfmemsafe.planning._size_planner import SizePlanner

_DEFAULT_MAX_BATCH_SIZE = 4096


def find_max_batch_size(
    model: keras.Model,
    data,
    *,
    start: int = DEFAULT_BATCH_SIZE,
    max_batch_size: int = _DEFAULT_MAX_BATCH_SIZE,
    steps_per_trial: int = 2,
    headroom: float = memory.HEADROOM,
    memory_estimate: bool = True,
    verbose="auto",
) -> int:
    """Finds the largest batch size that trains with memory to spare.

    First it estimates the training step's memory
    (`tfmemsafe.estimate_memory`: a few short steps at small batch sizes)
    and trains `steps_per_trial` steps at the largest batch predicted to
    leave `headroom` of the device's limit free (rounded down to a
    multiple of 8, at most `max_batch_size` or the number of samples).
    When that trial confirms it, that is the answer: no size ran out of
    memory. When the trial disagrees, the search goes on below it; when
    no estimate can be made (see docs/memory-estimate.md), it searches by
    trial from `start`.

    The search by trial trains at `start`, then at twice that, and so
    on, until a size runs out of memory, or its peak memory (read with
    `tfmemsafe.memory_info`) leaves less than `headroom` of the device's
    limit free, or `max_batch_size` (or the number of samples) is reached.
    It then bisects between the last good and the first bad size, to
    within an eighth of the good one: each trial that runs out of memory
    costs about ten seconds, the time the allocator waits for memory to
    be freed before it gives up. If `start` is already bad, it halves
    down first.

    The model's weights, optimizer state (including the iteration count
    and a `LossScaleOptimizer`'s scale) and random-seed state are put back
    exactly as they were found.

    Without memory statistics (a CPU without `TF_CPU_ALLOCATOR_USE_BFC`)
    only out-of-memory errors and `max_batch_size` bound the search.

    Args:
        model: A compiled `keras.Model`.
        data: Training data of any kind `tfmemsafe.fit` accepts.
        start: int. The first batch size of the search by trial.
            Defaults to 32.
        max_batch_size: int. The largest batch size to try. Defaults to
            4096.
        steps_per_trial: int. Training steps per batch size tried.
            Defaults to 2.
        headroom: float. The fraction of the memory limit that must stay
            free at the peak, in [0, 1). Defaults to 0.1.
        memory_estimate: bool. Whether to start from a memory estimate;
            with `False`, only the search by trial. Defaults to `True`.
        verbose: `"auto"`, 0 or 1, as `model.fit` takes it: 1 (and
            `"auto"`) shows a progress bar of the estimate's probes; 0
            nothing. Defaults to `"auto"`.

    Returns:
        The largest good batch size found.

    Raises:
        OutOfMemoryError: If not even a batch of one fits.

    Example:
    >>> tfmemsafe.find_max_batch_size(model, (x, y), start=64)
    448
    """
    _checks.compiled_model(model, "find_max_batch_size")
    _checks.integer("start", start, 1)
    _checks.integer("max_batch_size", max_batch_size, 1)
    _checks.integer("steps_per_trial", steps_per_trial, 1)
    _checks.fraction("headroom", headroom)
    memory_estimate = _checks.boolean("memory_estimate", memory_estimate)
    _checks.verbose(verbose)
    source = source_for(
        data, "data", labelled=True, strategy=model.distribute_strategy
    )
    planner = SizePlanner(
        model,
        "tfmemsafe.find_max_batch_size",
        memory_estimate=memory_estimate,
        verbose=verbose,
    )
    return _search(
        model, source, start, max_batch_size, steps_per_trial, headroom, planner
    )


def _search(model, source, start, max_batch_size, steps, headroom, planner):
    """`find_max_batch_size` on checked arguments."""
    memory.reserve_one_region()  # Trials in the layout `fit` trains in.
    samples = source.num_samples
    largest = min(max_batch_size, samples) if samples else max_batch_size
    multiple = model.distribute_strategy.num_replicas_in_sync
    start = max(multiple, min(start, largest))
    trial = _Trial(model, source, steps, headroom, planner)
    try:
        good = bad = None
        size = start
        predicted = _predicted_size(
            planner, source, largest, multiple, headroom
        )
        if predicted is not None:
            if trial.fits(predicted):
                good = bad = predicted  # Confirmed: no search.
            else:
                bad, size = predicted, max(multiple, predicted // 2)
        while good is None:  # Halve down until something fits.
            smallest = size // 2 < multiple
            if trial.fits(size, last_chance=smallest):
                good = size
            elif smallest:  # It trains, only without the headroom.
                good = size
                logging.warning(
                    "tfmemsafe.find_max_batch_size: even batch %d leaves "
                    "less than %.0f%% of the memory free. %s",
                    size,
                    100 * headroom,
                    _messages.OOM_ADVICE,
                )
            else:
                bad, size = size, size // 2
        while bad is None and good < largest:  # Grow.
            size = min(good * 2, largest)
            if trial.fits(size):
                good = size
            else:
                bad = size
        while bad is not None and bad - good > max(multiple, good // 8):
            size = _round_down((good + bad) // 2, multiple, good)
            if trial.fits(size):
                good = size
            else:
                bad = size
    finally:
        trial.close()
    logging.info(
        "tfmemsafe.find_max_batch_size: %d (tried %s).",
        good,
        _messages.format_sizes(trial.tried),
    )
    return good


def _predicted_size(planner, source, largest, multiple, headroom) -> int | None:
    """The largest batch the planner predicts to leave `headroom` free,
    rounded down to a multiple of 8 (or of the replicas); `None` without
    an estimate or when not even the smallest is predicted to fit.
    """
    size = planner.max_batch_size(source, largest, multiple, headroom)
    if size is None:
        return None
    rounded = size - size % 8
    if rounded >= multiple and rounded % multiple == 0:
        size = rounded
    logging.info(
        "tfmemsafe.find_max_batch_size: the memory estimate predicts %d.", size
    )
    return size


class _Trial:
    """Trains a few steps at a batch size and says whether it fitted."""

    def __init__(self, model, source, steps, headroom, planner):
        self.model = model
        self.source = source
        self.steps = steps
        self.headroom = headroom
        self.planner = planner
        self.tried = []
        if not model.built:  # So that all its variables exist to be saved.
            model(source.sample_inputs(), training=False)
        self.state = ModelState(model)
        with model.distribute_strategy.scope():
            self.devices = memory.default_devices()
        self.limits = {
            device: memory.memory_info(device).limit_bytes
            for device in self.devices
        }
        self.window = memory.PeakWindow(self.devices)
        self.warned = False
        # False after an error that leaves the model unusable: nothing is
        # put back then, as that would use it.
        self.usable = True

    def fits(self, batch_size: int, last_chance: bool = False) -> bool:
        """Whether `batch_size` trains and leaves the headroom free.

        A trial is never retried: an out-of-memory error answers it.

        Raises:
            OutOfMemoryError: If it runs out and it was the last chance.
        """
        self.tried.append(batch_size)
        self.window.reset()

        def train() -> bool:
            self.model.fit(
                **self.source.trial_arguments(batch_size, self.steps),
                epochs=1,
                verbose=0,
            )
            return True

        def give_up_if_last_chance(err) -> None:
            if last_chance:
                raise OutOfMemoryError(
                    f"Could not fit a training batch of {batch_size} after "
                    f"trying {_messages.format_sizes(self.tried)}. "
                    f"{_messages.OOM_ADVICE}",
                    self.tried,
                ) from err

        def ran_out(_) -> bool:
            self.planner.record_ran_out("training", self.source, batch_size)
            logging.info(
                "tfmemsafe.find_max_batch_size: batch %d ran out of memory.",
                batch_size,
            )
            return False

        try:
            trained = retry_on_oom(
                self.model, train, give_up_if_last_chance, ran_out
            )
        except ModelUnusableError:
            self.usable = False
            raise
        finally:
            if self.usable:
                # Its traced functions stay for the next trial.
                self.state.restore_values()
                release(self.model)
        if trained:
            self.planner.record_trained("training", self.source, batch_size)
        return trained and self._peak_leaves_headroom(batch_size)

    def _peak_leaves_headroom(self, batch_size) -> bool:
        fractions = []
        for device in self.devices:
            peak = self.window.peak_bytes(device)
            limit = self.limits[device]
            # A peak of 0 means the device keeps no statistics.
            if peak and limit:
                fractions.append((peak, limit))
        if not fractions:
            if not self.warned:
                self.warned = True
                logging.warning(
                    "tfmemsafe.find_max_batch_size: no memory statistics on "
                    "%s; only out-of-memory errors and `max_batch_size` "
                    "bound the search.",
                    ", ".join(self.devices),
                )
            return True
        logging.info(
            "tfmemsafe.find_max_batch_size: batch %d peaked at %.0f%% of "
            "the memory limit.",
            batch_size,
            100 * max(peak / limit for peak, limit in fractions),
        )
        return all(
            memory.fits_within(peak, limit, self.headroom)
            for peak, limit in fractions
        )

    def close(self) -> None:
        if self.usable:
            # The search's traces stay for the run that follows; `history`
            # is the caller's again.
            self.state.restore_values()
            self.model.history = self.state.attributes["history"]
            release(self.model)
        self.state.close()


def _round_down(size: int, multiple: int, good: int) -> int:
    """Rounds to a multiple of 8 (or of the replicas) above `good`."""
    for step in (8, multiple):
        rounded = size - size % step
        if rounded > good and rounded % multiple == 0:
            return rounded
    return size
