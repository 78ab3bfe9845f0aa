"""One attempt at a held batch, in micro-batches of a given size, each
measured: `MicroBatches`.

`HeldSteps` decides the size of an attempt's micro-batches and what
follows an error; `MicroBatches` runs the attempt: the whole batch through
the model's step, training's micro-batches through `SplitBatch` into one
update, or evaluation's (and a model's own `train_step`'s) as calls of
the step on slices. Each (micro-)batch's peak above what was in use before
it goes to the `MicroBatchSize` in use, and an error is charged to the
rows that were running.
"""

from __future__ import annotations

import math

from tfmemsafe import memory
from tfmemsafe.recovery._agreed_step import agreed_rows
from tfmemsafe.recovery._held_batches import joined
from tfmemsafe.recovery._held_batches import joined_replicas
from tfmemsafe.recovery._held_batches import reduced
from tfmemsafe.recovery._held_batches import sliced
from tfmemsafe.recovery._output_losses import OutputLosses


class MicroBatches:
    """Runs attempts at held batches for one model's run.

    Args:
        model: The compiled `keras.Model`.
        guard: The run's `StepGuard`.
        steps: The run's `ModelSteps`.
        split: The run's `SplitBatch`.
        readings: The run's `DeviceReadings`.
        agreed_step: The run's `AgreedStep`, under a multi-worker
            strategy; else `None`.
        one_update: bool. Whether a training batch's micro-batches make
            one update (Keras' own `train_step`, or `AccumulatingModel`'s).
    """

    def __init__(
        self, model, guard, steps, split, readings, agreed_step, one_update
    ):
        self.guard = guard
        self.strategy = model.distribute_strategy
        self.readings = readings
        self._steps = steps
        self._split = split
        self._agreed_step = agreed_step
        self._one_update = one_update
        self._losses = OutputLosses(model)
        self._size = None  # The attempt's `MicroBatchSize`.
        # The attempt's micro-batches begun and planned, and the rows of
        # the one running (what an error is charged to).
        self.begun = self.planned = 0
        self.running = None

    def run(self, name: str, batch, rows: int, piece: int, size, recover):
        """`batch`, of `rows`, through the `name` step in micro-batches of
        `piece` rows, sized and measured by `size` (a `MicroBatchSize`).

        `recover(err, rows)` is called after a slice of `rows` ran out
        (of evaluation, prediction, or a model's own `train_step`: each
        slice a call of its own): it must put back what the slice changed
        (saved before it), drop `err`'s traceback (which holds the
        slice's tensors) and set the next size, or raise to end the
        attempt; the slice then runs again at the size `size` gives. Any
        other error ends the attempt: the caller puts back what it
        changed.
        """
        self._size = size
        self.begun = self.planned = 0
        # What ran out, if the attempt does before a micro-batch runs
        # (the split's sums); `_measured` says which micro-batch did.
        self.running = min(piece, rows)
        if piece >= rows:
            return self._measured(name, rows, lambda: self._whole(name, batch))
        if name == "train" and self._one_update:
            return self._split_train(batch, rows, piece)
        return self._in_pieces(name, batch, rows, piece, recover)

    def _whole(self, name: str, batch):
        if self._agreed_step is not None and name == "train":
            return self._agreed_step(iter([batch]))
        return reduced(self.strategy, name, self._steps(name, batch))

    def _split_train(self, batch, rows: int, piece: int):
        """`batch` as micro-batches of Keras' step and one update."""
        split = self._split
        split.begin(batch)
        try:
            if self.strategy.num_replicas_in_sync > 1:
                # Equal pieces of every share; a probe's size sets them.
                piece = agreed_rows(
                    self.strategy, self._size.probe_rows() or piece
                )
                # Every worker's rows are the job's most (`agreed_sizes`).
                pieces = min(
                    math.ceil(rows / piece),
                    agreed_rows(self.strategy, split.most_pieces()),
                )
                self.planned = pieces
                for index in range(pieces):
                    bounds = split.uniform_bounds(index, pieces)
                    largest = max(end - start for start, end in bounds)
                    self._measured(
                        "train",
                        largest,
                        lambda bounds=bounds: split.on_every_worker(
                            lambda: split.train_piece(bounds)
                        ),
                    )
                return split.finish()
            self._each_piece(
                "train",
                rows,
                piece,
                self._losses.counted(
                    lambda start, end: split.train_piece([(start, end)])
                ),
            )
            return self._losses.finish(
                self._steps.static_rows("train", rows), split.finish()
            )
        finally:
            split.close()

    def _in_pieces(self, name: str, batch, rows: int, piece: int, recover):
        """`batch` through the `name` step in slices, each its own call:
        metrics add up, predictions are joined, and a model's own
        `train_step` makes its own update on each slice. A slice that runs
        out is tried again smaller; those before it stand."""
        replicas = self.strategy.num_replicas_in_sync
        reduce = name != "predict" or replicas == 1
        run = lambda start, end: reduced(  # noqa: E731
            self.strategy,
            name,
            self._steps(name, sliced(batch, start, end, self.strategy)),
            reduce,
        )
        # One evaluation call's per-output losses (a model's own
        # `train_step` updates on each slice: each is a call).
        one_call = name == "test" and replicas == 1
        if one_call:
            run = self._losses.counted(run)
        outputs = self._each_piece(name, rows, piece, run, recover)
        if one_call:
            static = self._steps.static_rows(name, rows)
            return self._losses.finish(static, outputs[-1])
        if name != "predict":
            return outputs[-1]
        if reduce:
            return joined(outputs)
        return joined_replicas(self.strategy, outputs)

    def _each_piece(
        self, name: str, rows: int, piece: int, run, recover=None
    ) -> list:
        """`run(start, end)` for consecutive micro-batches of `piece` rows
        of a batch of `rows`, each measured (a probe first, if
        `MicroBatchSize` asks for one, and then the size it sets); their
        results. Given `recover`, a micro-batch that runs out is run
        again smaller (each is a step of its own); else the error ends
        the attempt."""
        size, start, results = self._size, 0, []
        while start < rows:
            probe = size.probe_rows()
            end = min(rows, start + (probe or piece))
            self.planned = self.begun + 1
            self.planned += math.ceil((rows - end) / size.rows_for(rows))
            if recover is not None:
                self.guard.save_small_state()
            failure = None
            try:
                result = self._measured(
                    name, end - start, lambda s=start, e=end: run(s, e)
                )
            except Exception as err:  # noqa: BLE001 (re-raised unless OOM)
                if recover is None or not memory.is_oom_error(err):
                    raise
                failure = err
            if failure is not None:
                recover(failure, end - start)
                piece = size.rows_for(rows)
                continue
            results.append(result)
            if probe:
                piece = size.rows_for(rows)
            start = end
        return results

    def _measured(self, name: str, rows: int, run):
        """`run()`, a (micro-)batch of `rows`: an error in it is charged to
        `rows`, and its peak above what was in use before goes to
        `MicroBatchSize`."""
        before = self.readings.in_use()
        self.readings.reset()
        self.begun += 1
        self.running = rows
        result = run()
        self._size.measured(rows, self.readings.peak(), before)
        return result
