"""`MemoryEstimate`: the measured memory model, and what it predicts."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from tfmemsafe import _checks
from tfmemsafe import memory
from tfmemsafe._messages import mib
from tfmemsafe.estimate._lengths import along_the_logs
from tfmemsafe.estimate._lengths import polynomial

# `max_batch_size` keeps room for this many more of the step's largest
# tensors at the batch, beside the headroom: a step scheduled with one
# more alive than the probes' median step, and the BFC allocator's
# fragmentation, which only a chunk of that size can fill: without it, a
# network of few large tensors runs out at the line's size.
SPARE_TENSORS = 1


def largest_fitting(fits, start: int) -> int:
    """The largest `n >= start` with `fits(n)`, for `fits(start)` true.

    `fits` must be true up to some size and false beyond it (a peak grows
    with the batch and the length): doubling from `start`, then bisecting.
    """
    low, high = start, 2 * start
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """The peak memory of a training step as a line in the batch size.

    `peak_bytes(b) = fixed_bytes + per_sample_bytes * b`, fitted to the
    allocator's peaks at the larger probe sizes in `measurements` (those
    past the floor that small batches share).
    The fixed part holds the weights, the optimizer state, the gradients
    and whatever else the process keeps on the device (a dataset's arrays,
    say); the per-sample part the activations kept for the backward pass
    and the batch itself.

    Attributes:
        device: str. The device measured; under a `tf.distribute`
            strategy, the replica device whose peak was highest.
        limit_bytes: int or `None`. The device's memory limit (see
            `tfmemsafe.memory_info`), if known.
        fixed_bytes: int. The line's value at batch 0.
        per_sample_bytes: float. The line's slope. Under a strategy, per
            sample of the global batch, on one replica device.
        measurements: tuple of `(batch_size, peak_bytes)` pairs, every
            probe at the data's own length, smallest first. Batch sizes
            are global.
        state_bytes: int. The model's, its metrics' and its optimizers'
            variables, counted (part of `fixed_bytes`).
        length: int or `None`. The data's length (axis 1 of its inputs)
            when the estimate has a second dimension, else `None`.
        length_coefficients: tuple of three floats, or `()`. The
            per-sample part at length `l` is `c0 + c1 l + c2 l^2` bytes,
            scaled so it is `per_sample_bytes` at `length`.
        length_fixed_coefficients: tuple of three floats, or `()`. What
            a length adds to the fixed part: `c0 + c1 l + c2 l^2` bytes
            less its value at `length` (never below 0).
        length_measurements: tuple of `(batch_size, length, peak_bytes)`
            triples: the probes at other lengths, and what was measured
            since (`tfmemsafe.data.memory_buckets` adds each bucket's
            batch). The per-sample part is raised where one of them held
            more than the polynomial predicts (`per_sample_bytes_at`), so
            a prediction is never below a measurement.
        largest_tensor_bytes: float. The bytes per sample of the step's
            largest tensor (from the traced forward pass);
            `max_batch_size` keeps room for `SPARE_TENSORS` of them.
        largest_tensor_lengths: tuple of `(length, bytes)` pairs, or `()`.
            The largest tensor's bytes per sample traced at the probes'
            other lengths (an attention's scores grow with the square of
            the length, faster than the per-sample part as a whole);
            `spare_bytes` interpolates between them.
        data_bytes: int. The data's tensors (arrays as `fit` converts
            them), in use before every probe and counted in `fixed_bytes`
            on a CPU device; 0 for a dataset or an accelerator.
        step_spread: float. How far the predictions' readings move: the
            most that the highest of a probe's steps peaked above its
            median step, as a fraction of the median, over every probe
            (0 for an estimate built by hand). Each reading, and so each
            prediction, is a median step's; a step's peak moves from step
            to step with the order its independent ops run in (side by
            side on a CPU's inter-op threads), and about this much more
            can be in use in some steps. `max_batch_size` keeps its spare
            tensor and headroom for that; it does not read this.
    """

    device: str
    limit_bytes: int | None
    fixed_bytes: int
    per_sample_bytes: float
    measurements: tuple[tuple[int, int], ...]
    state_bytes: int = 0
    length: int | None = None
    length_coefficients: tuple[float, ...] = ()
    length_measurements: tuple[tuple[int, int, int], ...] = ()
    largest_tensor_bytes: float = 0.0
    length_fixed_coefficients: tuple[float, ...] = ()
    data_bytes: int = 0
    largest_tensor_lengths: tuple[tuple[int, float], ...] = ()
    step_spread: float = 0.0

    def peak_bytes(self, batch_size: int, length: int | None = None) -> int:
        """The predicted peak of a training step at `batch_size`.

        Args:
            batch_size: int. A (global) batch size.
            length: int or `None`. The samples' length (axis 1 of the
                inputs), for an estimate made with `lengths`. Defaults to
                `None`, the data's own.

        Returns:
            The predicted peak in bytes.

        Raises:
            ValueError: If `length` is given to an estimate made without
                `lengths`.
        """
        batch_size = _checks.integer("batch_size", batch_size, 1)
        per_sample = self.per_sample_bytes_at(length)
        fixed = self.fixed_bytes_at(length)
        return int(math.ceil(fixed + per_sample * batch_size))

    def fixed_bytes_at(self, length: int | None = None) -> float:
        """The fixed part at `length` (the data's own for `None`)."""
        if length is None or length == self.length:
            return float(self.fixed_bytes)
        self._fitted_per_sample(length)  # Checks `length`.
        if not self.length_fixed_coefficients:
            return float(self.fixed_bytes)
        added = polynomial(self.length_fixed_coefficients, length)
        added -= polynomial(self.length_fixed_coefficients, self.length)
        return self.fixed_bytes + max(added, 0.0)

    def spare_bytes(self, batch_size: int, length: int | None = None) -> int:
        """The room `max_batch_size` keeps beside the predicted peak."""
        largest = self.largest_tensor_bytes_at(length) * batch_size
        return int(math.ceil(SPARE_TENSORS * largest))

    def largest_tensor_bytes_at(self, length: int | None = None) -> float:
        """The step's largest tensor's bytes per sample at `length`.

        Where it was traced (`largest_tensor_lengths`, and the data's own
        length), that; between traced lengths, interpolated in the logs of
        both; beyond them, the nearest pair's power of the length carried
        on, at most the square past the longest (the per-sample part holds
        no higher power) and at most the length itself below the
        shortest. An estimate without two traced lengths scales it with
        the per-sample part.

        Raises:
            ValueError: If `length` is given to an estimate made without
                `lengths`.
        """
        if length is None or length == self.length:
            return self.largest_tensor_bytes
        self._fitted_per_sample(length)  # Checks `length`.
        traced = dict(self.largest_tensor_lengths)
        traced.setdefault(self.length, self.largest_tensor_bytes)
        points = sorted((n, b) for n, b in traced.items() if b > 0)
        if len(points) < 2:
            scale = self.per_sample_bytes_at(length) / self.per_sample_bytes
            return max(self.largest_tensor_bytes * scale, 0.0)
        return along_the_logs(points, length)

    def _fits(self, batch_size, length, usable) -> bool:
        peak = self.peak_bytes(batch_size, length)
        return peak + self.spare_bytes(batch_size, length) <= usable

    def per_sample_bytes_at(self, length: int | None = None) -> float:
        """The per-sample part at `length` (the data's own for `None`).

        The polynomial's value, raised where a measurement at a length
        (`length_measurements`) held more than it predicts: there, by as
        much as the measurement needs; between measured lengths, by what
        the two nearest needed, interpolated in the log of the length;
        beyond them, by what the nearest needed. Never below its value
        at a shorter measured length: a longer sample holds no less.
        """
        if length is None:
            length = self.length
        if length is None or not self.length_coefficients:
            if length is not None and length != self.length:
                self._fitted_per_sample(length)  # Raises.
            return self.per_sample_bytes
        return max(
            self._lifted(n)
            for n in {length, *self._needed_lifts}
            if n <= length
        )

    def _lifted(self, length: int) -> float:
        return self._fitted_per_sample(length) * self._lift(length)

    def _fitted_per_sample(self, length: int) -> float:
        """The per-sample part at `length` by the line and the polynomial."""
        if length == self.length:
            return self.per_sample_bytes
        length = _checks.integer("length", length, 1)
        if not self.length_coefficients:
            raise ValueError(
                "`length` needs an estimate with a second dimension: pass "
                "`lengths` to `estimate_memory`. Received: "
                f"length={length}"
            )
        return self.per_sample_bytes * (
            polynomial(self.length_coefficients, length)
            / polynomial(self.length_coefficients, self.length)
        )

    def _lift(self, length: int) -> float:
        """How much the per-sample part at `length` is raised (>= 1)."""
        needed = self._needed_lifts
        if not needed:
            return 1.0
        lengths = sorted(needed)
        return float(
            np.interp(
                math.log(length),
                [math.log(n) for n in lengths],
                [needed[n] for n in lengths],
            )
        )

    @functools.cached_property
    def _needed_lifts(self) -> dict:
        """Each measured length's lift: what its highest measurement off
        the floor needs the per-sample part raised by (1 where none needs
        it; 1 at the data's own length unless measured there)."""
        needed = {}
        for size, length, peak in self.length_measurements:
            fixed = self.fixed_bytes_at(length)
            fitted = size * self._fitted_per_sample(length)
            if fitted < fixed:
                # On the floor: at a batch this small the moment of the
                # fixed part sets the peak, which says nothing of the
                # per-sample part (29 samples of 8 tokens peaked 2.5
                # times the line's per-sample part above the fixed).
                continue
            lift = (peak - fixed) / fitted
            needed[length] = max(needed.get(length, 1.0), lift)
        if needed:
            needed.setdefault(self.length, 1.0)
        return needed

    def max_batch_size(
        self,
        limit_bytes: int | None = None,
        headroom: float = memory.HEADROOM,
        multiple: int = 1,
        length: int | None = None,
    ) -> int:
        """The largest batch whose predicted peak leaves `headroom` free.

        Args:
            limit_bytes: int or `None`. The memory to fit in; lets you ask
                about a device you do not have ("would batch 512 fit a
                16 GiB card?"). Defaults to `None`, the measured device's
                `limit_bytes`.
            headroom: float. The fraction of the limit to leave free, in
                [0, 1), for what the line does not see: the allocator's
                fragmentation, a different convolution algorithm at a
                larger size, other work on the device. Defaults to 0.1.
            multiple: int. Round down to a multiple of this (the number
                of replicas, say). Defaults to 1.
            length: int or `None`. The samples' length, as in
                `peak_bytes`. Defaults to `None`, the data's own.

        Returns:
            The batch size, or 0 when not even `multiple` samples are
            predicted to fit.

        Raises:
            ValueError: If an argument is out of range, or `limit_bytes`
                is `None` and the device's limit is unknown.

        Example:
        >>> estimate.max_batch_size(limit_bytes=16 * 1024**3, multiple=8)
        4096
        """
        usable = self._usable_bytes(limit_bytes, headroom)
        multiple = _checks.integer("multiple", multiple, 1)
        if not self._fits(multiple, length, usable):
            return 0
        low = largest_fitting(
            lambda size: self._fits(size, length, usable), multiple
        )
        return low - low % multiple

    def _usable_bytes(self, limit_bytes, headroom) -> int:
        """What a limit leaves usable; the measured device's for `None`."""
        if limit_bytes is None:
            limit_bytes = self.limit_bytes
            if limit_bytes is None:
                raise ValueError(
                    f"`limit_bytes` is required: the memory limit of "
                    f"{self.device} is unknown. Received: limit_bytes=None"
                )
        limit_bytes = _checks.integer("limit_bytes", limit_bytes, 1)
        headroom = _checks.fraction("headroom", headroom)
        return memory.usable_bytes(limit_bytes, headroom)

    def max_length(
        self,
        batch_size: int = 1,
        limit_bytes: int | None = None,
        headroom: float = memory.HEADROOM,
    ) -> int:
        """The longest samples of which `batch_size` are predicted to fit.

        For an estimate made with `lengths`.

        Args:
            batch_size: int. How many samples. Defaults to 1.
            limit_bytes: int or `None`. As in `max_batch_size`.
            headroom: float. As in `max_batch_size`.

        Returns:
            The length, or 0 when not even length 1 fits.
        """
        batch_size = _checks.integer("batch_size", batch_size, 1)
        if not self.length_coefficients:
            raise ValueError(
                "`max_length` needs an estimate with a second dimension: "
                "pass `lengths` to `estimate_memory`."
            )
        usable = self._usable_bytes(limit_bytes, headroom)
        if self.peak_bytes(batch_size, 1) > usable:
            return 0
        return largest_fitting(
            lambda length: self.peak_bytes(batch_size, length) <= usable, 1
        )

    def __str__(self) -> str:
        return _table(self)


def _table(estimate) -> str:
    """`str(estimate)`: its line, and each measurement beside the
    prediction."""
    limit = (
        "limit unknown"
        if estimate.limit_bytes is None
        else f"limit {mib(estimate.limit_bytes)}"
    )
    lines = [
        f"MemoryEstimate on {estimate.device} ({limit})",
        f"  peak = {mib(estimate.fixed_bytes)} + "
        f"{estimate.per_sample_bytes / 1024:.1f} KiB x batch",
        f"  {'batch':>8}  {'measured':>12}  {'predicted':>12}  error",
    ]
    if estimate.step_spread > 0:
        lines.insert(
            2,
            "  each measured: the median of a probe's steps; the highest "
            f"step peaked up to {100 * estimate.step_spread:+.1f}% above it",
        )
    for size, peak in estimate.measurements:
        predicted = estimate.peak_bytes(size)
        lines.append(
            f"  {size:>8}  {mib(peak):>12}  {mib(predicted):>12}  "
            f"{100 * (predicted - peak) / peak:+.1f}%"
        )
    if estimate.length_coefficients:
        c0, c1, c2 = estimate.length_coefficients
        lines.insert(
            2,
            f"  per sample at length l: proportional to {c0:.4g} + "
            f"{c1:.4g} l + {c2:.4g} l^2 (data's length {estimate.length})",
        )
        if any(estimate.length_fixed_coefficients):
            f0, f1, f2 = estimate.length_fixed_coefficients
            lines.insert(
                3,
                f"  fixed at length l: + {f0:.4g} + {f1:.4g} l + "
                f"{f2:.4g} l^2 bytes, less that at {estimate.length}",
            )
        for size, length, peak in estimate.length_measurements:
            predicted = estimate.peak_bytes(size, length)
            lines.append(
                f"  {size:>8}  {mib(peak):>12}  {mib(predicted):>12}  "
                f"{100 * (predicted - peak) / peak:+.1f}%  "
                f"(length {length})"
            )
    if estimate.limit_bytes is not None:
        lines.append(
            f"  largest batch with {100 * memory.HEADROOM:.0f}% headroom: "
            f"{estimate.max_batch_size()}"
        )
    return "\n".join(lines)
