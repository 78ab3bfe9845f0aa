"""The one rule for what fits: what was measured first, then the estimate.

A `SizePlanner` answers every "does it fit" of `fit`'s pre-flight check
and of `find_max_batch_size` (and so `batch_size="auto"`). What this
process has measured is a fact and comes first: a size that trained at
a step and shape fits it, and a size that ran out does not. Between the
two, first a static bound of the step, from the traced forward pass and
counted state (`estimate._graph`): a batch under it fits without a
probe. Only then a `MemoryEstimate` of the step decides, with one rule,
`memory.fits_within` (`memory.HEADROOM` of the limit left free), its
prediction plus what something else holds on the device now. The facts
and the estimates are kept per model, for the life of the process, keyed
by the step (training, evaluation, prediction), the optimizer and the
shape of a sample; an estimate that could not be made says why once, and
is not tried again in that call.
"""

from __future__ import annotations

import weakref

import keras
from absl import logging

from tfmemsafe import distribute
from tfmemsafe import estimate as estimate_lib
from tfmemsafe import memory
from tfmemsafe._messages import mib
from tfmemsafe.errors import MemoryEstimateError
from tfmemsafe.errors import OutOfMemoryError
from tfmemsafe.planning._memory_plan import STATIC_BOUND

# The compiled step each phase runs.
_STEPS = {
    "training": "train",
    "validation": "test",
    "evaluation": "test",
    "prediction": "predict",
}


class _Facts:
    """What one step at one sample shape has done in this process.

    Attributes:
        trained: int. The largest batch size that trained (0 for none).
        ran_out: int or `None`. The smallest that ran out of memory.
        estimate: `MemoryEstimate` or `None`. The step's estimate, once
            made.
    """

    def __init__(self):
        self.trained = 0
        self.ran_out = None
        self.estimate = None
        self.bound = _UNTRACED


_UNTRACED = object()

# Per model: `(step, optimizer id, sample signature)` to its `_Facts`.
_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class SizePlanner:
    """The sizes that fit one model's steps: measured, else predicted.

    Args:
        model: The `keras.Model`.
        caller: str. The public function asking, for log lines.
        memory_estimate: bool. Whether it may estimate (run probes); with
            `False` it answers from measurements alone.
        verbose: `"auto"`, 0 or 1. A progress bar of the probes, as
            `model.fit`'s. Defaults to 0.
    """

    def __init__(
        self, model: keras.Model, caller: str, *, memory_estimate, verbose=0
    ):
        self.model = model
        self.caller = caller
        self.memory_estimate = memory_estimate
        self.verbose = verbose
        self._facts = _MEASURED.setdefault(model, {})
        self._refused = {}  # Key to why no estimate could be made.

    def record_trained(self, phase: str, source, batch_size: int) -> None:
        """Notes that `batch_size` trained (or ran) `phase`'s step."""
        facts = self._facts_of(phase, source)
        facts.trained = max(facts.trained, batch_size)
        if _over(facts.trained, facts.ran_out):
            facts.ran_out = None  # The newer measurement.

    def record_ran_out(self, phase: str, source, batch_size: int) -> None:
        """Notes that `batch_size` ran out of memory in `phase`'s step."""
        facts = self._facts_of(phase, source)
        if facts.ran_out is None or batch_size < facts.ran_out:
            facts.ran_out = batch_size
        # A size that ran out is no longer known to fit, whatever ran
        # before (memory held elsewhere, fragmentation).
        facts.trained = min(facts.trained, batch_size - 1)

    def halvings(
        self,
        phase: str,
        source,
        batch_size: int,
        floor: int,
        *,
        largest_probe: int,
    ) -> tuple[int, str]:
        """How often to halve `batch_size` for `phase`'s step to fit.

        A size at or above one that ran out is halved; a size at or below
        one that trained is not; in between the static bound, then the
        estimate decide (made now if not yet), with probes no larger than
        `largest_probe`. It stops at `floor`.

        Returns:
            The number of halvings (0 when nothing says to halve), and
            what decided it (`""` for none).
        """
        facts = self._facts_of(phase, source)
        size, count, why = batch_size, 0, ""
        while _over(size, facts.ran_out) and size // 2 >= floor:
            size, count = size // 2, count + 1
            why = f"batch size {facts.ran_out} ran out of memory before"
        if size <= facts.trained or self._under_bound(facts, source, size):
            return count, why
        made = self.estimate(phase, source, largest_probe)
        if made is None:
            return count, why
        start = size
        while (
            not _predicted_to_fit(made, size, source)
            and size // 2 >= floor
            and size > facts.trained
        ):
            size, count = size // 2, count + 1
        if size != start:
            why = _against_limit(made, _predicted_peak(made, start, source))
        return count, why

    def peak_bytes(
        self,
        phase: str,
        source,
        batch_size: int,
        *,
        largest_probe: int,
        limit,
        beside: int = 0,
    ) -> tuple[float | None, str]:
        """The predicted peak of `phase`'s step at `batch_size`, beside
        what something else holds now and `beside` bytes more, and what
        predicted it.

        The static bound when it fits `limit` (bytes, with
        `memory.HEADROOM` left free), else the estimate (made now if not
        yet, with probes no larger than `largest_probe`).

        Returns:
            `(peak, "static bound")`, `(peak, "estimate")`, or
            `(None, why)` where neither can be known.
        """
        facts = self._facts_of(phase, source)
        if self._under_bound(facts, source, batch_size):
            bound = facts.bound.peak_bytes(batch_size, source) + beside
            if memory.fits_within(bound, limit):
                return bound, STATIC_BOUND
        made = self.estimate(phase, source, largest_probe)
        if made is None:
            return None, self._refused.get(
                self._key(phase, source), "no estimate"
            )
        peak = _predicted_peak(made, batch_size, source) + beside
        return peak, "estimate"

    def max_batch_size(
        self, source, largest: int, multiple: int, headroom: float
    ) -> int | None:
        """The largest training batch the estimate predicts to fit, at
        most `largest`, a multiple of `multiple`; `None` without one."""
        made = self.estimate("training", source, largest)
        if made is None:
            return None
        size = _largest_predicted(made, source, headroom)
        size = min(size, largest)
        size -= size % multiple
        return size if size >= multiple else None

    def estimate(self, phase: str, source, largest: int):
        """`phase`'s `MemoryEstimate`, made now if not yet; or `None`."""
        if not self.memory_estimate:
            return None
        key = self._key(phase, source)
        facts = self._facts_of(phase, source)
        if facts.estimate is None and key not in self._refused:
            made, why = self._make(phase, source, largest)
            if made is None:
                self._refused[key] = why
                logging.info(
                    "%s: no memory estimate for %s, so it halves once per "
                    "out-of-memory error: %s",
                    self.caller,
                    phase,
                    why,
                )
            facts.estimate = made
        return facts.estimate

    def _make(self, phase: str, source, largest: int):
        if distribute.is_multi_worker(self.model.distribute_strategy):
            return None, "a multi-worker job (workers could choose differently)"
        try:
            made = estimate_lib.estimate_source(
                self.model,
                source,
                phase=phase,
                largest=largest,
                guarded=True,
                verbose=self.verbose,
            )
        except (MemoryEstimateError, OutOfMemoryError) as err:
            return None, str(err)
        except Exception as err:  # noqa: BLE001
            # Left for the real step to raise, where the callbacks see it.
            return None, f"estimating raised {type(err).__name__}"
        if made.limit_bytes is None:
            return None, f"the memory limit of {made.device} is unknown"
        return made, ""

    def _under_bound(self, facts, source, batch_size: int) -> bool:
        """Whether the step's static bound at `batch_size` fits, now."""
        if not self.memory_estimate:
            return False
        if facts.bound is _UNTRACED:
            facts.bound = _StaticBound.of(self.model, source)
        return facts.bound is not None and facts.bound.fits(batch_size, source)

    def _key(self, phase: str, source) -> tuple:
        optimizer = id(self.model.optimizer) if phase == "training" else 0
        return (_STEPS[phase], optimizer, source.sample_signature())

    def _facts_of(self, phase: str, source) -> _Facts:
        return self._facts.setdefault(self._key(phase, source), _Facts())


def _over(size: int, ran_out: int | None) -> bool:
    return ran_out is not None and size >= ran_out


def _own_peak(made, batch_size: int, source) -> float:
    """The predicted peak of the step and its spare room, on `source`: its
    data's tensors in place of those the probes counted (`data_on`; the
    same, or another source's of the same sample shape)."""
    peak = made.peak_bytes(batch_size) + made.spare_bytes(batch_size)
    return peak - made.data_bytes + estimate_lib.data_on(made.device, source)


def _held_beside(made, source) -> int:
    """What is in use now that `_own_peak` does not count already: not the
    model's state, nor `source`'s tensors where they are in memory now
    (`data_held_on`; counted twice, 96 MiB of images made the pre-flight
    check cut a batch of 128 that trains to 32 under a 450 MB cap)."""
    data = estimate_lib.data_held_on(made.device, source)
    return estimate_lib.held_bytes(made.device, made.state_bytes + data)


def _predicted_peak(made, batch_size: int, source) -> float:
    """The predicted peak and its spare room on `source`, beside what
    something else holds now."""
    return _own_peak(made, batch_size, source) + _held_beside(made, source)


def _against_limit(made, peak: float) -> str:
    """`"peak 812.3 MiB predicted against 90% of 450.0 MiB on CPU:0"`."""
    return (
        f"peak {mib(peak)} predicted against "
        f"{100 * (1 - memory.HEADROOM):.0f}% of {mib(made.limit_bytes)} on "
        f"{made.device}"
    )


def _predicted_to_fit(made, batch_size: int, source, headroom=None) -> bool:
    return memory.fits_within(
        _predicted_peak(made, batch_size, source),
        made.limit_bytes,
        memory.HEADROOM if headroom is None else headroom,
    )


def _largest_predicted(made, source, headroom: float) -> int:
    """The largest batch `_predicted_to_fit` with `headroom`, or 0."""
    if not _predicted_to_fit(made, 1, source, headroom):
        return 0
    return estimate_lib.largest_fitting(
        lambda size: _predicted_to_fit(made, size, source, headroom), 1
    )


class _StaticBound:
    """The step's bound before any probe (see `estimate._graph`)."""

    def __init__(self, model, terms, state_bytes, limits):
        self.fixed, self.per_sample = terms
        self.state_bytes = state_bytes
        self.limits = limits
        self.replicas = model.distribute_strategy.num_replicas_in_sync

    @classmethod
    def of(cls, model, source):
        """The bound, or `None` where it cannot be known."""
        devices = estimate_lib.devices_of(model)
        limits = {d: memory.memory_info(d).limit_bytes for d in devices}
        if not all(limits.values()):
            return None
        if not model.built:  # So that the optimizer is built for all.
            with model.distribute_strategy.scope():
                model(source.sample_inputs(), training=False)
        if model.optimizer is not None and not model.optimizer.built:
            # Its slots are state too; `fit` would build it (zero state).
            with model.distribute_strategy.scope():
                model.optimizer.build(model.trainable_variables)
        state = estimate_lib.state_bytes(model)
        terms = estimate_lib.bound_terms(model, source.sample_inputs(), state)
        if terms is None:
            return None
        return cls(model, terms, state, limits)

    def fits(self, batch_size: int, source) -> bool:
        """Whether the bound at `batch_size` fits on every device, with
        `source`'s tensors (whether in memory yet or not) and what
        something else holds now."""
        return all(
            memory.fits_within(peak, self.limits[device])
            for device, peak in self._peaks(batch_size, source)
        )

    def peak_bytes(self, batch_size: int, source) -> float:
        """The highest bound of the devices, counted as `fits` counts it."""
        return max(peak for _, peak in self._peaks(batch_size, source))

    def _peaks(self, batch_size: int, source):
        per_replica = -(-batch_size // self.replicas)
        bound = self.fixed + self.per_sample * per_replica
        for device in self.limits:
            data = estimate_lib.data_on(device, source)
            now = estimate_lib.data_held_on(device, source)
            held = estimate_lib.held_bytes(device, self.state_bytes + now)
            yield device, bound + data + held
