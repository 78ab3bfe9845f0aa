"""One held batch trained as micro-batches of one update: `SplitBatch`.

`MicroBatches` opens a split when a batch ran out of memory (`begin`),
trains its micro-batches (`train_piece`), and makes the one update
(`finish`).

The micro-batches go through the model's own `train_step`, so its loss,
metrics and regularization are Keras' own. While they run, the
`StepGuard` hands the step's update (`optimizer.apply`, or an
`AccumulatingModel`'s `accumulate`) to `SplitBatch` instead, which sums
each micro-batch's gradients weighted by its share of the batch; once all
of them are done, the weighted mean goes to that update once. An update
of a loss that averages over the batch (Keras' default) is then the one
the whole batch would have made, to rounding; a window of an
`AccumulatingModel` counts the batch once. If a micro-batch runs out too,
the sums are dropped (nothing else was changed) and the batch is split
finer.

Under a `tf.distribute.MirroredStrategy` (one machine, several devices)
each replica's share of the batch, as TensorFlow shares it, is trained
in pieces: a micro-batch is a piece of every share. Each replica sums
its own gradients weighted by its piece's rows, and its part of the one
update divides by its share's rows; the update's all-reduce adds the
replicas' parts, as in Keras' own step: the update of the whole batch,
to rounding.

Under a `MultiWorkerMirroredStrategy` each micro-batch is a worker's own
part, with no collective; the workers agree after each (`on_every_worker`):
one that runs out on any worker splits the batch finer on all of them.
"""

from __future__ import annotations

import threading

import numpy as np
import tensorflow as tf

from tfmemsafe import _compat
from tfmemsafe import distribute
from tfmemsafe import estimate
from tfmemsafe._step_guard import StepGuard
from tfmemsafe._step_guard import traced
from tfmemsafe.recovery._agreed_step import agree
from tfmemsafe.recovery._agreed_step import update_name
from tfmemsafe.recovery._agreed_step import updated_variables
from tfmemsafe.recovery._held_batches import local_shares
from tfmemsafe.recovery._held_batches import rows_of
from tfmemsafe.recovery._held_batches import sliced


class SplitBatch:
    """Trains one batch as micro-batches accumulated into one update.

    Args:
        model: The `keras.Model` being trained.
        guard: The call's `StepGuard` (it hands the update over).
    """

    def __init__(self, model, guard: StepGuard):
        self.model = model
        self.guard = guard
        self.strategy = model.distribute_strategy
        self._replicas = self.strategy.num_replicas_in_sync
        # This worker's replicas (all of them, but under a multi-worker
        # strategy): the shares it holds.
        self._local = (
            1
            if self._replicas == 1
            else len(self.strategy.extended.worker_devices)
        )
        # The open split (`begin` to `close`): each replica's share of
        # its batch, the compiled micro-batch step and its last logs.
        self._shares, self._step, self._logs = [], None, None
        self._update_function = self._dense_update = self._zero = None
        self._pieces_traced = False
        self._sums = {}  # id(variable) -> its weighted gradient sum.
        self._total = None  # The micro-batches' weights, summed.
        self._size = None  # Their sizes, for a window closed by size.
        self._updates = {}  # id(owner) -> (owner, method name, variables).
        self._dense = set()  # id(variable) of those with a dense gradient.
        # id(variable) -> its micro-batches' sparse `(values, indices)`.
        self._sparse = {}
        # While a micro-batch's step is traced, per replica (each traces
        # it in a thread of its own): its rows (`rows`) and its sparse
        # gradients, `(id(variable), (values, indices))` (`sparse`).
        self._traced = threading.local()
        self._sparse_ids = []  # Whose those of the traced step's output are.
        self._workers = distribute.is_multi_worker(self.strategy)
        # What TensorFlow registered for the graphs traced here, which
        # holds them and what they capture (`release` drops it).
        self._registered = []

    def begin(self, batch) -> None:
        """Opens the split of `batch` (a batch as Keras' step takes it, or
        one of `tf.distribute` values, a share on each replica): its
        gradient sums start at zero. The sums and the compiled steps are
        made at the first split and kept until `release`, so that later
        splits trace nothing again."""
        self._shares = local_shares(batch, self.strategy)
        self._sparse = {}
        if self._sums:
            self._zero()
            return
        # Made before the sums (whose creation under a multi-worker
        # strategy is a collective), so that one worker's failure to make
        # them is every worker's.
        zeros = self.on_every_worker(
            lambda: [
                tf.zeros(v.shape, v.dtype)
                for v in self.model.trainable_variables
            ]
        )
        with self.strategy.scope():
            self._sums = {
                id(v): _summed(zero)
                for v, zero in zip(
                    self.model.trainable_variables, zeros, strict=True
                )
            }
            self._total = _summed(0.0)
            self._size = _summed(0.0)
        del zeros
        self._updates, self._dense = {}, set()
        self._pieces_traced = False
        # Compiled whole, `strategy.run` inside, as Keras compiles its
        # step (a compiled function run per GPU replica could not
        # `merge_call`, which an `AccumulatingModel`'s step does).
        self._step = tf.function(
            lambda piece: self.strategy.run(self._micro_batch, args=(piece,)),
            autograph=False,  # As Keras compiles its step.
            reduce_retracing=True,
            jit_compile=self.model.jit_compile is True,
        )
        self._update_function = tf.function(
            lambda sparse: self.strategy.run(self._update, args=(sparse,)),
            autograph=False,
        )
        self._dense_update = None
        self._zero = traced(self._assign_zeros)

    def _assign_zeros(self):
        for variable in [*self._sums.values(), self._total, self._size]:
            variable.assign(tf.zeros(variable.shape, variable.dtype))

    def sum_bytes(self) -> int:
        """The bytes the next split's gradient sums will take that are not
        taken now (none while a split's are kept)."""
        if self._sums:
            return 0
        return estimate.gradient_bytes(self.model)

    def share_rows(self) -> list:
        """The rows of each replica's share of the open split's batch."""
        return [rows_of(share) for share in self._shares]

    def most_pieces(self) -> int:
        """The most pieces the open split's batch is split into: each
        keeps a row of every replica's share (of those with any)."""
        return int(min((r for r in self.share_rows() if r), default=1))

    def uniform_bounds(self, index: int, pieces: int) -> list:
        """Rows `(start, end)` of each share that piece `index` of
        `pieces` equal pieces trains."""
        bounds = []
        for rows in self.share_rows():
            cuts = np.linspace(0, rows, pieces + 1).astype(int)
            bounds.append((int(cuts[index]), int(cuts[index + 1])))
        return bounds

    def train_piece(self, bounds) -> dict:
        """Trains one micro-batch: rows `bounds[r]` of each replica `r`'s
        share, its gradients added to the sums (the update waits for
        `finish`).

        Returns:
            The micro-batch's logs, as its step returned them.

        Raises:
            tf.errors.ResourceExhaustedError: It ran out; the split's sums
                are then unusable (`close` it).
        """
        piece = self._piece(bounds)
        with self.guard.deferring(update_name(self.model), self._defer):
            with _compat.recording_custom_gradients(self._registered):
                if self._replicas == 1 and not self._pieces_traced:
                    # Traced for any rows, as Keras traces its own step.
                    self._step.get_concrete_function(_any_rows(piece))
                    self._pieces_traced = True
                logs, parts = self._step(piece)
        for key, part in zip(self._sparse_ids, parts, strict=True):
            self._sparse.setdefault(key, []).append(part)
        self._logs = logs
        return logs

    def finish(self) -> dict:
        """Makes the one update of the pieces trained, and returns the
        step's logs (the metrics after its last micro-batch)."""
        with _compat.recording_custom_gradients(self._registered):
            if self._sparse:
                self._update_function(self._sparse)
            else:
                if self._dense_update is None:
                    # Traced once, as the pieces' step: calls of a concrete
                    # function are not counted by TensorFlow's retracing
                    # warning (a trace a run, in a loop of short runs).
                    self._dense_update = (
                        self._update_function.get_concrete_function({})
                    )
                self._dense_update({})
        logs = self._logs
        if self._replicas > 1:
            # Each replica's metrics are its own share's; read them
            # all. Anything else (an `AccumulatingModel`'s
            # `skipped_windows`) is the same on every replica.
            metrics = self.model.get_metrics_result()
            logs = {
                name: metrics[name]
                if name in metrics
                else self.strategy.experimental_local_results(value)[0]
                for name, value in logs.items()
            }
        return {name: _python(value) for name, value in logs.items()}

    def close(self) -> None:
        """Ends the open split: drops its batch and sparse parts (the sums
        are kept for the next split)."""
        self._shares, self._sparse, self._logs = [], {}, None

    def release(self) -> None:
        """Drops the sums and the compiled steps, and what TensorFlow
        keeps of the steps' graphs, so that the sums are freed."""
        self._sums, self._total, self._updates = {}, None, {}
        self._size = self._step = self._update_function = None
        self._dense_update = self._zero = None
        self._dense = set()
        _compat.forget_custom_gradients(self._registered)

    def on_every_worker(self, work):
        """`work()`'s result; under a multi-worker strategy, once every
        worker's has finished, and if any failed, an error on every
        worker (`agree`)."""
        try:
            result = work()
        except Exception as err:
            if self._workers:
                agree(self.strategy, err)  # Raises.
            raise
        if self._workers:
            agree(self.strategy, None)
        return result

    def _piece(self, bounds):
        """The micro-batch of rows `bounds[r]` of each replica `r`'s
        share: under a strategy, on each replica."""
        if self._replicas == 1:
            return sliced(self._shares[0], *bounds[0])
        # A worker's replicas are numbered on from the workers' before it.
        return self.strategy.experimental_distribute_values_from_function(
            lambda context: sliced(
                self._shares[context.replica_id_in_sync_group % self._local],
                *bounds[context.replica_id_in_sync_group % self._local],
            )
        )

    def _micro_batch(self, data):
        """One micro-batch's step (on one replica, its share); with the
        sparse gradients it deferred, which are kept as they come (see
        `_defer`)."""
        self._traced.rows = tf.cast(
            tf.shape(tf.nest.flatten(data)[0])[0], tf.float32
        )
        self._traced.sparse = []
        logs = self.model.train_step(data)
        self._sparse_ids = [key for key, _ in self._traced.sparse]
        return logs, [part for _, part in self._traced.sparse]

    def _defer(
        self,
        owner,
        name,
        gradients,
        trainable_variables=None,
        sample_count=None,
        size=None,
    ):
        """The update a micro-batch's step asked for, added to the sums.

        An `accumulate` call weighs its micro-batch by `sample_count` (its
        samples, or its sample-weight sum), and adds `size` to the
        window's (its samples or tokens); an `apply` call's micro-batch
        weighs its rows, as the loss averages over them (under a strategy,
        its rows on this replica: each replica's update is the mean of its
        share's, which the update's all-reduce adds up as Keras' does).
        A sparse gradient (an `Embedding`'s `tf.IndexedSlices`) is kept
        whole, a row per token: the optimizer's update of the whole
        batch's slices is not the update of their sum per row (Keras'
        Adam squares each slice).
        """
        variables = updated_variables(self.model, trainable_variables)
        weight = (
            self._traced.rows
            if sample_count is None
            else tf.cast(sample_count, tf.float32)
        )
        for gradient, variable in zip(gradients, variables, strict=True):
            if gradient is None:
                continue
            scale = tf.cast(weight, gradient.dtype)
            if isinstance(gradient, tf.IndexedSlices):
                self._traced.sparse.append(
                    (id(variable), (gradient.values * scale, gradient.indices))
                )
            else:
                self._dense.add(id(variable))
                self._sums[id(variable)].assign_add(gradient * scale)
        self._total.assign_add(weight)
        self._size.assign_add(
            weight if size is None else tf.cast(size, tf.float32)
        )
        self._updates[id(owner)] = (owner, name, variables)

    def _update(self, sparse):
        """The one update, with the weighted mean of the micro-batches
        (on each replica, of its own sums: the update all-reduces)."""
        for owner, name, variables in self._updates.values():
            means = [self._mean(v, sparse.get(id(v))) for v in variables]
            if name == "apply":
                owner.apply(means, variables)
            else:
                owner.accumulate(means, variables, self._total, size=self._size)
                owner.apply_if_ready(self.model.optimizer)

    def _mean(self, variable, parts):
        """`variable`'s gradient over the whole batch, or `None`. (A
        replica whose share was empty, of a batch of fewer rows than
        replicas, adds nothing.)"""
        total = tf.cast(self._total, variable.dtype)
        dense = None
        if id(variable) in self._dense:
            dense = tf.math.divide_no_nan(self._sums[id(variable)], total)
        if not parts:
            return dense
        values, indices = zip(*parts, strict=True)
        slices = tf.IndexedSlices(
            tf.math.divide_no_nan(tf.concat(values, 0), total),
            tf.concat(indices, 0),
            tf.shape(variable, out_type=indices[0].dtype),
        )
        return slices if dense is None else dense + tf.convert_to_tensor(slices)


def _summed(initial) -> tf.Variable:
    """A sum of the split batch's: under a strategy, each replica's own
    (read in a replica, its own; outside, all of them added)."""
    return tf.Variable(
        initial,
        trainable=False,
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.SUM,
    )


def _any_rows(batch):
    """The spec of `batch` with any number of rows."""
    return tf.nest.map_structure(
        lambda t: (
            None if t is None else tf.TensorSpec([None, *t.shape[1:]], t.dtype)
        ),
        batch,
    )


def _python(value):
    value = np.asarray(value)
    return value.item() if value.ndim == 0 else value
