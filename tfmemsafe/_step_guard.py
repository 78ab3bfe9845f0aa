"""What a training step that runs out of memory can have changed.

In a `tf.function` TensorFlow runs each op as soon as its inputs are
ready; ops on different variables are not ordered. So in a step that runs
out of memory during backpropagation, the last layer's optimizer update
(its gradients come first) may already have run, and the optimizer's
`iterations.assign_add(1)`, which needs no gradient at all, may have run
even when no data came (Keras' extra call at the end of a dataset of
unknown length). Metric updates and BatchNormalization's
moving statistics run in the forward pass, before any gradient.

`StepGuard`, installed for one `tfmemsafe.fit` call (and for the probes
of the estimates `fit` makes, so that they measure the step it trains),
makes that knowable:

- A barrier: every optimizer's `apply` and every `GradientAccumulator`'s
  `accumulate` waits until all of its gradients exist, and every op it
  creates (the `iterations` increment included) depends on them. An out of
  memory error in the forward or backward pass then leaves the trainable
  variables, the optimizers' variables and the accumulation windows
  untouched, and a step without data changes nothing.
- A marker: the barrier also sets a flag variable before the first update
  of a step. After an error, `touched()` says whether any update began; a
  step that failed inside `apply` itself is the one case where the epoch
  snapshot has to be put back.
- An order: while the barrier's update is traced, each variable's update
  (an optimizer's `update_step`) waits for the one before it, and inside
  it each `assign`, `assign_add` or `assign_sub` waits for the previous
  one. Released together by the barrier, the updates would otherwise run
  at once, each with temporaries the size of its variable: Adam's step
  then peaked at one more copy of the largest variable than under
  `model.fit` (measured in docs/oom-recovery.md). In order, it peaks
  lower than `model.fit`, and at the same figure every step.
- A device-side copy of the small state a forward pass changes (metric
  variables, the non-trainable variables of trainable layers such as
  moving statistics, random seed states), taken before each step by
  `save_small_state()` and put back by `restore_small_state()`.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import keras
import tensorflow as tf

from tfmemsafe import _compat
from tfmemsafe._model_state import local_parts

# The guard installed on each model, if any.
_INSTALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class StepGuard:
    """The barrier, the marker and the small-state copy of one model.

    Args:
        model: The `keras.Model` being trained.
        optimizers: The optimizers whose `apply` gets the barrier.
        accumulators: The `GradientAccumulator`s whose `accumulate` gets it.
    """

    def __init__(self, model, optimizers, accumulators):
        self.model = model
        self._patched = []
        self._deferred = self._sink = None
        # While an update is traced in order: what the next op waits for,
        # and the open `control_dependencies` of the current `update_step`.
        self._after = self._within = None
        # Its variables first: allocating them can run out of memory, and
        # then nothing is patched yet.
        with tf.init_scope():
            self._touched = tf.Variable(False, trainable=False)
        self._copy_small_state()
        for optimizer in optimizers:
            self._patch(optimizer, "apply")
        for optimizer in _with_inner(optimizers):
            self._order(optimizer)
        for accumulator in accumulators:
            self._patch(accumulator, "accumulate")
            self._hold_window(accumulator)
        # A step Keras traced before (an earlier `model.fit`) has neither
        # barrier nor order: traced again at the next call.
        model.train_function = None
        _INSTALLED[model] = self

    @staticmethod
    def installed_on(model) -> bool:
        """Whether a guard is installed on `model` now."""
        return model in _INSTALLED

    def _patch(self, owner, name):
        original = getattr(owner, name)
        guard = self

        @functools.wraps(original)
        def guarded(gradients, *args, **kwargs):
            if guard._deferred == name and tf.inside_function():
                return guard._sink(owner, name, gradients, *args, **kwargs)
            gradients = list(gradients)
            present = [g for g in gradients if g is not None]
            if not tf.inside_function() or not present:
                guard._touched.assign(True)
                return original(gradients, *args, **kwargs)
            args, kwargs = _build_before_the_barrier(owner, args, kwargs)
            # One op over every gradient: nothing after it starts before
            # the whole backward pass is done.
            flat = tf.identity_n([_dense(g) for g in present])
            ready = iter(flat)
            gradients = [
                None if g is None else _like(g, next(ready)) for g in gradients
            ]
            with tf.control_dependencies(flat):
                mark = guard._mark()
            with tf.control_dependencies([mark]), guard._in_order():
                return original(gradients, *args, **kwargs)

        # An instance attribute, so only this object and only this run.
        vars(owner)[name] = guarded
        self._patched.append((owner, name))

    def _hold_window(self, accumulator):
        """While `accumulate` is deferred, the window is not applied in
        the traced step either: its micro-batch is not in it yet, and the
        deferred update applies it (`SplitBatch`). So the step has no
        cross-replica work at all (a window closed by size sums the
        replicas' sizes even when it is not full)."""
        guard = self
        original = accumulator.apply_if_ready

        @functools.wraps(original)
        def apply_if_ready(*args, **kwargs):
            if guard._deferred == "accumulate" and tf.inside_function():
                return tf.constant(False)
            return original(*args, **kwargs)

        vars(accumulator)["apply_if_ready"] = apply_if_ready
        self._patched.append((accumulator, "apply_if_ready"))

    # Not converted by AutoGraph (the step that calls it is): nothing in
    # it branches on a tensor, and the import `_compat` makes in it is
    # not code AutoGraph can read.
    @tf.autograph.experimental.do_not_convert
    def _mark(self):
        """Sets the marker, after the control dependencies open where it is
        called: the gradients of the replica that calls it.

        Under a `tf.distribute` strategy each replica reaches the barrier
        with its own gradients, and one that finishes first must not mark
        the step while another still runs out of memory in its backward
        pass: nothing is updated before every replica's gradients are
        reduced. So there the marker is set once for this worker's
        replicas, after all of their gradients (`_compat.cross_replica`).
        Other workers' errors are agreed on before the update
        (`AgreedStep`).
        """
        if tf.distribute.in_cross_replica_context():
            return self._touched.assign(True, read_value=False)
        return _compat.cross_replica(
            lambda _: self._touched.assign(True, read_value=False)
        )

    @contextlib.contextmanager
    def _in_order(self):
        """Orders the updates traced meanwhile (see `_order`).

        Not under a `tf.distribute` strategy: there a variable's update
        is made on every replica's device, and one chain through them all
        would make each device wait for the others.
        """
        if tf.distribute.has_strategy():
            yield
            return
        self._after = []
        try:
            yield
        finally:
            self._after = self._within = None

    def _order(self, optimizer):
        """Makes `optimizer`'s variable updates run one after another.

        `update_step` and `assign`, `assign_add`, `assign_sub` are the
        public methods through which a Keras optimizer updates a
        variable. While `_in_order` is open, every op an `update_step`
        creates waits for the last assignment before it, and after each
        assignment a marker op on the assigned variable (ordered after the
        assignment by `tf.function`'s automatic control dependencies, and
        reading nothing) becomes what the following ops wait for. An
        `update_step` that assigns in another way still starts after the
        last assignment ordered before it.
        """
        guard = self
        step = optimizer.update_step

        @functools.wraps(step)
        def update_step(gradient, variable, learning_rate):
            if guard._after is None:
                return step(gradient, variable, learning_rate)
            # A marker traced in another graph (one branch of a `cond`,
            # as in `LossScaleOptimizer`) cannot be waited for here.
            graph = tf.compat.v1.get_default_graph()
            after = [op for op in guard._after if op.graph is graph]
            with contextlib.ExitStack() as within:
                within.enter_context(tf.control_dependencies(after))
                guard._within = within
                try:
                    return step(gradient, variable, learning_rate)
                finally:
                    guard._within = None

        vars(optimizer)["update_step"] = update_step
        self._patched.append((optimizer, "update_step"))
        for name in ("assign", "assign_add", "assign_sub"):
            self._order_assignment(optimizer, name)

    def _order_assignment(self, optimizer, name):
        guard = self
        assign = getattr(optimizer, name)

        @functools.wraps(assign)
        def ordered(variable, value):
            result = assign(variable, value)
            # A Keras variable and a `tf.Variable` both have `handle`.
            handle = getattr(variable, "handle", None)
            if guard._within is not None and handle is not None:
                marker = tf.raw_ops.VarIsInitializedOp(resource=handle)
                guard._after = [marker]
                guard._within.enter_context(tf.control_dependencies([marker]))
            return result

        vars(optimizer)[name] = ordered
        self._patched.append((optimizer, name))

    @contextlib.contextmanager
    def deferring(self, name: str, sink):
        """Hands each `name` call (`"apply"` or `"accumulate"`) traced
        meanwhile to `sink` instead.

        `sink(owner, name, gradients, *args)` is called, while a step is
        traced, in place of `owner.name(gradients, *args)`: `SplitBatch`
        sums a split batch's micro-batches there and makes their update
        once. Only the step's own update is deferred: an `apply` that an
        `accumulate`'s window makes when full is traced as it is, and a
        deferred `accumulate` holds back its window's `apply_if_ready`.
        """
        self._deferred, self._sink = name, sink
        try:
            yield
        finally:
            self._deferred, self._sink = None, None

    def close(self) -> None:
        """Removes the barrier (and the step traced with it)."""
        for owner, name in self._patched:
            vars(owner).pop(name, None)
        self._patched = []
        self.model.train_function = None
        if _INSTALLED.get(self.model) is self:
            del _INSTALLED[self.model]

    def _copy_small_state(self) -> None:
        """Makes a copy of each small-state variable, and the functions
        that save and restore them; again when the model has more metric
        variables (Keras makes the compiled metrics' at the first step)."""
        self._metric_count = len(self.model.metrics_variables)
        # Each replica's part of a distributed variable on its own: read
        # or assigned whole, a metric's (summed on read) would be the sum
        # over the replicas, and its assignment split between them.
        self._small = [
            part
            for variable in _small_state(self.model)
            for part in local_parts(variable)
        ]
        copies = []
        with tf.init_scope():
            for part in self._small:
                with tf.device(part.device):
                    copies.append(
                        tf.Variable(
                            tf.zeros(part.shape, part.dtype),
                            trainable=False,
                            name="copy",
                        )
                    )
        self._copies = copies
        self._save = traced(self._save_eagerly)
        self._restore = None  # Traced at its first use.

    def _save_eagerly(self):
        for copy, variable in zip(self._copies, self._small, strict=True):
            copy.assign(variable)
        self._touched.assign(False)

    def _restore_eagerly(self):
        for copy, variable in zip(self._copies, self._small, strict=True):
            variable.assign(copy)

    def save_small_state(self) -> None:
        """Copies the small state and clears the marker; before a step."""
        if len(self.model.metrics_variables) != self._metric_count:
            self._copy_small_state()
        self._save()

    def restore_small_state(self) -> None:
        """Puts the small state back as `save_small_state` found it.

        A metric whose variables the failed step made (Keras builds the
        compiled metrics at the first step) had no value before it: it is
        reset to its start."""
        if self._small:
            if self._restore is None:
                self._restore = traced(self._restore_eagerly)
            self._restore()
        if len(self.model.metrics_variables) != self._metric_count:
            copied = {id(part) for part in self._small}
            for metric in self.model.metrics:
                parts = [p for v in metric.variables for p in local_parts(v)]
                if any(id(part) not in copied for part in parts):
                    metric.reset_state()

    def touched(self) -> bool:
        """Whether an update of the failed step may have begun."""
        return bool(self._touched.numpy())


def traced(function):
    """`function` traced now, to be called as a concrete function: what it
    assigns is captured, so a call passes nothing (passing each variable
    as an argument costs several times as much a call), and calls of a
    concrete function are not counted by TensorFlow's retracing warning,
    which would otherwise name the guard after a few short runs in one
    process (a trace a run, all of one source function). Its loops over
    Python lists give AutoGraph nothing to convert."""
    return tf.function(function, autograph=False).get_concrete_function()


def _with_inner(optimizers) -> list:
    """The optimizers and those they wrap (`LossScaleOptimizer`'s)."""
    found = []
    for optimizer in optimizers:
        found.append(optimizer)
        inner = getattr(optimizer, "inner_optimizer", None)
        if isinstance(inner, keras.optimizers.Optimizer):
            found.append(inner)
    return list({id(o): o for o in found}.values())


def _small_state(model) -> list:
    """The variables a forward pass or a metric update can change.

    Metric variables, the model's own non-trainable variables and those of
    trainable layers (moving statistics), and seed generator states. A
    frozen layer's weights are left out: nothing assigns them.
    """
    found = list(model.metrics_variables)
    for layer in [model, *_compat.nested_layers(model)]:
        if layer.trainable:
            found += _compat.own_non_trainable_variables(layer)
        found += _compat.seed_generator_states(layer)
    trainable = {id(v) for v in model.trainable_variables}
    unique = {id(v): v for v in found if id(v) not in trainable}
    return list(unique.values())


def _dense(gradient):
    if isinstance(gradient, tf.IndexedSlices):
        return gradient.values
    return gradient


def _like(original, tensor):
    if isinstance(original, tf.IndexedSlices):
        return tf.IndexedSlices(tensor, original.indices, original.dense_shape)
    return tensor


def _build_before_the_barrier(owner, args, kwargs) -> tuple:
    """Builds an optimizer that its first `apply` would build (one a
    model's own `train_step` holds, built lazily as in Keras' GAN guide)
    as Keras' `apply` builds it, before the barrier: under the barrier's
    control dependencies its slots' initial values would depend on the
    step's gradients, and TensorFlow cannot lift such a variable out of
    the traced step. Returns `apply`'s arguments, the variables as a list
    (they may come as a generator, which building reads)."""
    variables = kwargs.get("trainable_variables", args[0] if args else None)
    if (
        not isinstance(owner, keras.optimizers.Optimizer)
        or owner.built
        or variables is None
    ):
        return args, kwargs
    variables = list(variables)
    with keras.name_scope(owner.name, caller=owner):
        owner.build(variables)
    if "trainable_variables" in kwargs:
        return args, {**kwargs, "trainable_variables": variables}
    return (variables, *args[1:]), kwargs
