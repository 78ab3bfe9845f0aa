"""Keras' step functions with each batch held, so that one that runs out
of memory is trained again as micro-batches: `HeldSteps`.

Keras' `fit` calls `model.train_function(iterator)` once a step, from
plain Python. `HeldSteps.train` takes that place: it reads the step's
batch from the iterator (eagerly, as Keras' own step would inside its
function), trains it with Keras' `train_step`, and when that raises an
out-of-memory error (`tfmemsafe.is_oom_error`), trains the same batch
again as micro-batches whose gradients make one update (`SplitBatch`),
sized by `MicroBatchSize` and run by `MicroBatches`. Nothing before the
batch is replayed, no sample is skipped or seen twice, the data pipeline
is not touched.
`test` and `predict` do the same for `evaluate` and `predict`. What a
failed attempt changed is put back by the run's `StepGuard`.
"""

from __future__ import annotations

from tfmemsafe import distribute
from tfmemsafe import memory
from tfmemsafe._unrecoverable import refuse_xla_on_cpu
from tfmemsafe.accumulation import accumulation_steps_of
from tfmemsafe.errors import OutOfMemoryError
from tfmemsafe.recovery._agreed_step import AgreedStep
from tfmemsafe.recovery._agreed_step import agreed_rows
from tfmemsafe.recovery._agreed_step import agreed_sizes
from tfmemsafe.recovery._exact_split import OWN_STEP
from tfmemsafe.recovery._exact_split import SplitRefusals
from tfmemsafe.recovery._exact_split import keras_step
from tfmemsafe.recovery._held_batches import example_shape
from tfmemsafe.recovery._held_batches import joined
from tfmemsafe.recovery._held_batches import read
from tfmemsafe.recovery._held_batches import rows_of
from tfmemsafe.recovery._held_batches import share_rows
from tfmemsafe.recovery._held_batches import without_optionals
from tfmemsafe.recovery._micro_batch_size import DeviceReadings
from tfmemsafe.recovery._micro_batch_size import MicroBatchSize
from tfmemsafe.recovery._micro_batches import MicroBatches
from tfmemsafe.recovery._model_steps import ModelSteps
from tfmemsafe.recovery._run_record import RunRecord
from tfmemsafe.recovery._run_record import given_up
from tfmemsafe.recovery._run_record import in_the_update
from tfmemsafe.recovery._run_record import not_split
from tfmemsafe.recovery._run_record import one_example
from tfmemsafe.recovery._run_record import retries_used_up
from tfmemsafe.recovery._split import SplitBatch

# What an attempt that ran out returns (its micro-batches were made
# smaller): no logs of any step are this object.
_RAN_OUT = object()


class HeldSteps:
    """The train, test and predict functions of one model's run.

    Args:
        model: The compiled `keras.Model`.
        guard: The run's `StepGuard`.
        grow_back_after: int or `None`. Clean steps before micro-batches
            grow back; `None`: never.
        split_batch_norm: bool. Whether a model whose `BatchNormalization`
            trains is split all the same.
        micro_batch_size: int or `None`. The rows of training's
            micro-batches at the start; `None`: whole batches.
        min_micro_batch_size: int. The fewest rows of a micro-batch.
        max_retries: int or `None`. The errors to recover from; `None`:
            no limit.
    """

    def __init__(
        self,
        model,
        guard,
        grow_back_after: int | None,
        split_batch_norm: bool,
        micro_batch_size: int | None = None,
        min_micro_batch_size: int = 1,
        max_retries: int | None = None,
    ):
        self.model = model
        self.max_retries = max_retries
        self.guard = guard
        self.strategy = model.distribute_strategy
        self.readings = DeviceReadings(self.strategy)
        limit = self.readings.limit_bytes
        # One per phase and shape of an example: evaluation needs less
        # memory than training, and a batch of length buckets' longest
        # examples more a row than one of the shortest.
        self._sizes = {}
        self._new_size = lambda rows: MicroBatchSize(
            grow_back_after, limit, rows=rows, floor=min_micro_batch_size
        )
        self._micro_batch_size = micro_batch_size  # Training's, at first.
        self._one_update = keras_step(model)
        self._size = None  # The current batch's.
        # Under a multi-worker strategy every worker takes each decision
        # alike, and a training step's error reaches every worker before
        # any update (`AgreedStep`).
        self._workers = distribute.is_multi_worker(self.strategy)
        self._agreed_step = AgreedStep(model, guard) if self._workers else None
        self.record = RunRecord()
        self._split = SplitBatch(model, guard)
        self._refusals = SplitRefusals(model, split_batch_norm)
        self._steps = ModelSteps(model)
        self._micro_batches = MicroBatches(
            model,
            guard,
            self._steps,
            self._split,
            self.readings,
            self._agreed_step,
            self._one_update,
        )

    def close(self) -> None:
        """Frees what the run's splits keep (their gradient sums)."""
        self._split.release()

    # Keras' functions.

    def train(self, iterator):
        """`model.train_function`: the next steps' batches, trained."""
        batches = read(iterator, self.model.steps_per_execution)
        self._steps.build_optimizer(batches[0])
        self._steps.trace_on("train", iterator)
        for batch in batches:
            logs = self._run("train", batch)
        return logs

    def test(self, iterator):
        """`model.test_function`: the next steps' batches, evaluated."""
        batches = read(iterator, self.model.steps_per_execution)
        self._steps.trace_on("test", iterator)
        for batch in batches:
            logs = self._run("test", batch)
        return logs

    def predict(self, batches):
        """`model.predict_function`: the outputs of `batches` (the list
        Keras reads for a call), joined."""
        outputs = [
            self._run("predict", without_optionals(batch)) for batch in batches
        ]
        return joined(outputs)

    # One batch.

    def _run(self, name: str, batch):
        """`batch` through the `name` step, in micro-batches as many as
        `MicroBatchSize` says; again in smaller ones after an OOM."""
        key = (name, example_shape(batch))
        if key not in self._sizes:
            rows = self._micro_batch_size if name == "train" else None
            if rows is not None and not self._one_update:
                self.record.not_split_from_the_start(name, rows, OWN_STEP)
                rows = None
            self._sizes[key] = self._new_size(rows)
        size = self._size = self._sizes[key]
        rows = rows_of(batch)
        in_use = self.readings.in_use() if size.grow_back_due() else None
        grown = size.grow_back_rows(in_use)
        piece = size.rows_for(rows)
        if piece < rows:
            # Split from the start too only where exact (after an error,
            # a batch that cannot be split raised then).
            refusal = self._refusals.of(name, batch)
            if isinstance(refusal, str):
                self.record.not_split_from_the_start(name, piece, refusal)
                size.whole()
                piece = rows
        if self._workers:
            # One exchange: every worker takes the same path and sizes.
            rows, grown, piece = agreed_sizes(self.strategy, rows, grown, piece)
        if grown is not None:
            before = size.rows_for(rows)
            result = self._attempt(name, batch, rows, grown)
            if result is not _RAN_OUT:
                size.grew_back(grown, rows)
                if name == "train" and size.rows is None:
                    self._split.release()  # Whole batches again.
                self.record.grew_back(
                    name,
                    before,
                    min(grown, rows),
                    in_use,
                    accumulation_steps_of(self.model),
                )
                size.trained()
                return result
        while True:
            result = self._attempt(name, batch, rows, piece)
            if result is not _RAN_OUT:
                size.trained()
                return result
            piece = agreed_rows(self.strategy, size.rows_for(rows))

    def _attempt(self, name: str, batch, rows: int, piece: int):
        """`batch` through the `name` step in micro-batches of `piece`
        rows; `_RAN_OUT` when it ran out and they were made smaller.

        Raises:
            OutOfMemoryError: They cannot be made smaller, or the batch
                cannot be split exactly.
        """
        self.guard.save_small_state()
        attempt = self._micro_batches
        failure = None
        try:
            result = attempt.run(
                name,
                batch,
                rows,
                piece,
                self._size,
                lambda err, ran: self._slice_ran_out(name, err, batch, ran),
            )
        except Exception as err:  # noqa: BLE001 (re-raised unless an OOM)
            ended = isinstance(err, OutOfMemoryError)  # Given up.
            if ended or not memory.is_oom_error(err):
                raise
            failure = err
        self.record.settle(max(attempt.planned, 1))
        if failure is None:
            return result
        self._recover(name, failure, batch, attempt.running)
        return _RAN_OUT

    def _slice_ran_out(self, name: str, err, batch, rows: int) -> None:
        """After a slice of `rows` of `batch`, a call of its own, ran out
        (`MicroBatches`): its event, and the next size."""
        self.record.settle(max(self._micro_batches.planned, 1))
        self._recover(name, err, batch, rows)

    def _recover(self, name: str, err, batch, piece: int) -> None:
        """After `err` (out of the `except` block that caught it, so that
        the failed attempt's tensors are freed with its frames): puts back
        what the attempt changed, then decides the next (`_after_oom`)."""
        err.__traceback__ = None  # Its frames hold the attempt's tensors.
        self.guard.restore_small_state()
        self._after_oom(name, err, batch, piece)

    def _after_oom(self, name: str, err, batch, piece: int):
        """Decides the next attempt after `err`, which micro-batches of
        `piece` rows ran into, or raises."""
        total = sum(share_rows(batch))
        refuse_xla_on_cpu(self.model, err)
        if self.guard.touched():
            raise given_up(in_the_update(total, err), total) from err
        refusal = self._refusals.of(name, batch)
        one_runs_out = None  # One example ran out: so would any micro-batch.
        if isinstance(refusal, BaseException):
            refusal, one_runs_out = None, refusal
        if refusal is not None:
            raise given_up(not_split(total, refusal, err), total) from err
        in_use = self.readings.in_use()
        if in_use is not None and name == "train" and self._one_update:
            # The split's gradient sums, which the next attempt makes.
            in_use += self._split.sum_bytes()
        if (
            self.max_retries is not None
            and self.record.errors >= self.max_retries
        ):
            message = retries_used_up(total, self.max_retries, err)
            raise given_up(message, total) from err
        smaller = None
        if one_runs_out is None:
            smaller = self._size.ran_out(piece, in_use)
        # Every worker raises, or none.
        smaller = agreed_rows(self.strategy, smaller)
        if smaller is None:
            cause = one_runs_out or err
            message = one_example(total, cause, self._size.floor)
            raise given_up(message, total) from cause
        self.record.ran_out(
            name,
            err,
            total,
            smaller,
            self._size.probe_rows(),
            accumulation_steps_of(self.model),
            self._one_update,
        )
