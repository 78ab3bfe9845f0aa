"""A multi-output model's per-output losses over a split batch:
`OutputLosses`.

Keras logs each output's loss (`<output>_loss`) as a `Mean` that each
call of the step adds the call's loss to, weighted by the rows of the
step's outputs as their static shape says: 1 where the batch's rows are
unknown when the step is traced, as they are for most data. A batch split
into micro-batches would so count as many calls. `OutputLosses` reads
what each micro-batch added and, once the batch is done, puts back the
one call the whole batch would have made: the rows-weighted mean of the
micro-batches' losses (the whole batch's, where the split is exact),
weighted as Keras' step weights it.
"""

from __future__ import annotations

import keras
from absl import logging

from tfmemsafe import _compat


class OutputLosses:
    """The per-output loss metrics of one model, over one split batch.

    Args:
        model: The compiled `keras.Model`.
    """

    def __init__(self, model):
        self.model = model
        self._start = self._last = None  # id(metric) -> (total, count).
        self._sums = {}  # id(metric) -> its micro-batches' loss x rows.
        self._rows = 0

    def begin(self) -> None:
        """Before a batch's first micro-batch."""
        self._start = self._last = self._read()
        self._sums, self._rows = {}, 0

    def piece_done(self, rows: int) -> None:
        """After a micro-batch of `rows` rows that finished (one that ran
        out was put back by the run's guard)."""
        now = self._read()
        for key, (total, count) in now.items():
            # A metric the first micro-batch built started at zero.
            last_total, last_count = self._last.get(key, (0.0, 0.0))
            added = count - last_count
            if added > 0:
                loss = (total - last_total) / added
                self._sums[key] = self._sums.get(key, 0.0) + loss * rows
        self._last = now
        self._rows += rows

    def counted(self, run):
        """Begins a batch; `run(start, end)`, a micro-batch of rows
        `start` to `end`, followed by `piece_done`."""
        self.begin()

        def counted(start, end):
            result = run(start, end)
            self.piece_done(end - start)
            return result

        return counted

    def finish(self, static_rows: int | None, logs: dict) -> dict:
        """Puts the batch's one call in place of its micro-batches' and
        returns `logs` with those losses as the metrics now read.

        Args:
            static_rows: The rows Keras' own step would weight the batch
                by: its static batch size when traced, `None` if unknown
                (a weight of 1).
            logs: The step's logs, after its last micro-batch.
        """
        weight = float(static_rows or 1)
        logs = dict(logs)
        for metric in self._metrics():
            key = id(metric)
            if key not in self._sums or not self._rows:
                continue
            total, count = self._start.get(key, (0.0, 0.0))
            loss = self._sums[key] / self._rows
            total_variable, count_variable = _total_and_count(metric)
            total_variable.assign(total + loss * weight)
            count_variable.assign(count + weight)
            if metric.name in logs:
                logs[metric.name] = float(metric.result())
        self._start = self._last = None
        return logs

    def _metrics(self) -> list:
        """The model's per-output loss `Mean`s (none with one output)."""
        compiled = _compat.compiled_loss_and_metrics(self.model)
        loss = compiled[1] if len(compiled) > 1 else None
        metrics = getattr(loss, "metrics", None) or []
        return [
            m
            for m in metrics
            if isinstance(m, keras.metrics.Mean)
            and _total_and_count(m) is not None
        ]

    def _read(self) -> dict:
        found = {}
        for metric in self._metrics():
            total, count = _total_and_count(metric)
            found[id(metric)] = (float(total.numpy()), float(count.numpy()))
        return found


_warned = False


def _total_and_count(metric):
    """A `keras.metrics.Mean`'s two variables, `total` and `count` (Keras
    3.15 and 3.16 name them so), or `None`, said once, where a Keras
    release names them otherwise: its split batches' logs then count each
    micro-batch as a call."""
    global _warned
    named = {v.name: v for v in metric.variables}
    if "total" in named and "count" in named:
        return named["total"], named["count"]
    if not _warned:
        _warned = True
        logging.warning(
            "SplitBatchOnOOM: this Keras names a Mean metric's variables "
            "%s, not 'total' and 'count', so a split batch's per-output "
            "losses count each micro-batch as a call of the step; the "
            "weights and the other logs are the whole batch's.",
            sorted(named),
        )
    return None
