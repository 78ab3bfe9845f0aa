"""Private Keras and TensorFlow names tfmemsafe reaches for, each in one
place.

Each function here reads one thing Keras (or TensorFlow) keeps under a
private name, says why no public API serves, and the versions it was
checked on (Keras 3.5, 3.8 and 3.15 unless it says otherwise; TensorFlow
2.21). Where a release moves the name, the function warns once and
falls back to a reading that refuses rather than guesses: a split
that cannot be shown exact is not made, a state that cannot be listed is
left out and said so. `tests/compat_test.py` fails loudly when a name
moves.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings

import keras

_warned = set()


def _moved(name: str, consequence: str, library: str = "keras") -> None:
    """Warns once that `library` (`"keras"` or `"tensorflow"`) moved
    `name`, and what follows."""
    if name in _warned:
        return
    _warned.add(name)
    title = "Keras" if library == "keras" else "TensorFlow"
    version = importlib.import_module(library).__version__
    warnings.warn(
        f"This {title} ({version}) has no `{name}`, which "
        f"tfmemsafe reads: {consequence} Please report it with your "
        f"{title} version.",
        RuntimeWarning,
        stacklevel=3,
    )


def nested_layers(model) -> list:
    """Every layer inside `model`, nested ones included, not `model`.

    Keras has no public walk of nested layers (`model.layers` is one
    level). Checked: `Layer._flatten_layers(include_self=False)`.
    """
    walk = getattr(model, "_flatten_layers", None)
    if walk is None:
        _moved(
            "Layer._flatten_layers",
            "only the top-level layers are searched.",
        )
        return list(getattr(model, "layers", []))
    return list(walk(include_self=False))


def own_non_trainable_variables(layer) -> list:
    """The non-trainable variables a layer made itself (moving statistics),
    not those of its sublayers. Keras' public `non_trainable_variables`
    also lists a frozen sublayer's weights, which nothing assigns.
    Checked: `Layer._non_trainable_variables`."""
    own = getattr(layer, "_non_trainable_variables", None)
    if own is None:
        _moved(
            "Layer._non_trainable_variables",
            "every non-trainable variable of the layer is saved instead.",
        )
        return list(layer.non_trainable_variables)
    return list(own)


def seed_generator_states(layer) -> list:
    """The state variables of a layer's `keras.random.SeedGenerator`s
    (a `Dropout`'s), which a training step advances. Keras lists no
    layer's generators publicly. Checked: `Layer._seed_generators`."""
    generators = getattr(layer, "_seed_generators", None)
    if generators is None:
        _moved(
            "Layer._seed_generators",
            "a failed step's random draws are not put back.",
        )
        return []
    return [generator.state for generator in generators]


def has_keras_mask(tensor) -> bool:
    """Whether a layer attached a Keras mask to `tensor`.

    `keras.ops` has no public reader of a tensor's mask. Checked:
    `keras.src.backend.common.masking.get_keras_mask` (Keras 3.6 to
    3.16.dev, which no longer re-exports it from `keras.src.backend`),
    and before it the attribute `_keras_mask` that it reads. Where neither
    is found, the tensor is taken to be masked: a loss over masked outputs
    does not average over the batch's rows, so a batch is then not split.
    """
    try:
        from keras.src.backend.common.masking import get_keras_mask
    except ImportError:
        if _version() < (3, 6):
            return getattr(tensor, "_keras_mask", None) is not None
        _moved(
            "keras.src.backend.common.masking.get_keras_mask",
            "every output is taken to be masked, so a batch that runs out "
            "of memory is not split.",
        )
        return True
    return get_keras_mask(tensor) is not None


def _version() -> tuple:
    return tuple(int(part) for part in keras.__version__.split(".")[:2])


@functools.cache
def activity_regularization_is_a_mean() -> bool:
    """Whether this Keras divides an activity regularizer's loss by the
    batch's rows, so that micro-batches weighted by their rows add up to
    the whole batch's (Keras 3.15 does; earlier releases summed it).

    Read from what Keras does rather than from its version: one layer's
    loss at two batch sizes of the same rows. No private name is read.
    """
    import numpy as np

    layer = keras.layers.Activation(
        "linear", activity_regularizer=keras.regularizers.L1(1.0)
    )
    losses = []
    for rows in (1, 2):
        layer(np.ones((rows, 1), "float32"))
        losses.append(float(sum(np.asarray(x) for x in layer.losses)))
    return abs(losses[0] - losses[1]) < 1e-6


def drop_cached_validation_iterator(model) -> None:
    """Lets go of the validation iterator Keras keeps on `model` during a
    `fit` (and the batches it prefetched), which a `fit` that raised
    leaves behind, so that its memory can be reused. Keras has no public
    way to drop it. Checked (Keras 3.15): `Trainer._eval_epoch_iterator`,
    which `fit` deletes when it ends normally; absent, there is nothing
    to drop (a rename keeps the memory held, and changes no result)."""
    if getattr(model, "_eval_epoch_iterator", None) is not None:
        model._eval_epoch_iterator = None


def compiled_loss_and_metrics(model) -> list:
    """The objects Keras builds from `compile`'s `loss` and `metrics` at
    the first batch (`None` before `compile`). Keras lists no compiled
    loss object publicly. Checked (Keras 3.15): `Trainer._compile_loss`
    and `Trainer._compile_metrics`; where they are gone, `[]`, and callers
    treat the model as not built."""
    try:
        return [model._compile_metrics, model._compile_loss]
    except AttributeError:
        _moved(
            "Trainer._compile_loss",
            "the model counts as not built, so Keras reads its sample batch.",
        )
        return []


def in_multi_worker_mode(strategy) -> bool:
    """Whether a `MultiWorkerMirroredStrategy` has read a cluster of more
    than one worker (from `TF_CONFIG`). TensorFlow says so publicly only
    through the cluster resolver's spec, which a strategy made without
    one lacks. Checked: `extended._in_multi_worker_mode()`; where it is
    gone, the cluster resolver's worker count."""
    read = getattr(strategy.extended, "_in_multi_worker_mode", None)
    if read is not None:
        return bool(read())
    _moved(
        "MultiWorkerMirroredStrategy.extended._in_multi_worker_mode",
        "the cluster resolver's workers are counted instead.",
        library="tensorflow",
    )
    return _resolver_workers(strategy) > 1


def _resolver_workers(strategy) -> int:
    """The workers and chief in a strategy's cluster resolver's spec (0
    without one)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    return len(spec.get("worker", [])) + len(spec.get("chief", []))


# Keras' scopes and random state, read by `Checkpointed`. Keras exports
# `keras.SymbolicScope`, `keras.StatelessScope` and `keras.random`, but
# not whether a scope is active, the scope that turns autocasting off, or
# the generator behind unseeded `keras.random` calls. Each is imported
# from the module that defines it, the same in Keras 3.5, 3.15 and
# 3.16.dev (which no longer re-exports `AutocastScope` from
# `keras.src.backend`). Where one is gone, `Checkpointed` runs its layer
# as it is: memory, not results, changes.


def in_symbolic_scope() -> bool:
    """Whether Keras is inferring shapes (`keras.SymbolicScope`). Checked:
    `keras.src.backend.common.symbolic_scope.in_symbolic_scope`; gone:
    `True`."""
    return _in_scope("symbolic_scope", "in_symbolic_scope")


def in_stateless_scope() -> bool:
    """Whether a `keras.StatelessScope` is active. Checked:
    `keras.src.backend.common.stateless_scope.in_stateless_scope`; gone:
    `True`."""
    return _in_scope("stateless_scope", "in_stateless_scope")


def _in_scope(module: str, name: str) -> bool:
    path = f"keras.src.backend.common.{module}"
    try:
        read = getattr(importlib.import_module(path), name, None)
    except ImportError:
        read = None
    if read is None:
        _moved(
            f"{path}.{name}", "`Checkpointed` layers run without checkpointing."
        )
        return True
    return bool(read())


def autocast_off():
    """A context in which Keras variables read as they are stored (under
    a mixed-precision policy, not cast to the compute dtype), or `None`.
    Checked: `keras.src.backend.common.variables.AutocastScope(None)`."""
    try:
        from keras.src.backend.common.variables import AutocastScope
    except ImportError:
        _moved(
            "keras.src.backend.common.variables.AutocastScope",
            "`Checkpointed` layers run without checkpointing.",
        )
        return None
    return AutocastScope(None)


def global_seed_generator(create: bool = False) -> tuple:
    """`(known, generator)`: the `keras.random.SeedGenerator` behind this
    thread's unseeded `keras.random` calls (made first if `create`), or
    `None` where the thread has none; `known` is `False` where Keras moved
    it. Checked: `keras.src.random.seed_generator.global_seed_generator`
    and the global attribute `"global_seed_generator"` it keeps in
    `keras.src.backend.common.global_state`."""
    try:
        from keras.src.backend.common.global_state import get_global_attribute
        from keras.src.random.seed_generator import global_seed_generator
    except ImportError:
        _moved(
            "keras.src.random.seed_generator.global_seed_generator",
            "`Checkpointed` layers run without checkpointing.",
        )
        return False, None
    if create:
        global_seed_generator()
    return True, get_global_attribute("global_seed_generator")


# TensorFlow's own. Checked on TensorFlow 2.16 and 2.21.


def onednn_enabled() -> bool:
    """Whether TensorFlow runs its CPU kernels through oneDNN. TensorFlow
    has no public reader: the flag follows `TF_ENABLE_ONEDNN_OPTS` and,
    unset, the CPU's features. Checked:
    `tensorflow.python.util._pywrap_util_port.IsMklEnabled`; gone: the
    environment variable alone (reported, not acted on)."""
    read = _from(
        "tensorflow.python.util._pywrap_util_port",
        "IsMklEnabled",
        "oneDNN is reported from TF_ENABLE_ONEDNN_OPTS alone.",
        library="tensorflow",
    )
    if read is None:
        import os

        setting = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "").lower()
        return setting in ("1", "true")
    return bool(read())


def eager_context_started() -> bool:
    """Whether TensorFlow's eager context, and so its devices and
    allocators, exist. Every public reader (`tf.config.list_logical_devices`)
    creates it. Checked: `tensorflow.python.eager.context.context_safe()`
    and its `_initialized`; gone: `True`, so that nothing is promised of
    a setting read only at start-up."""
    from tensorflow.python.eager import context

    read = getattr(context, "context_safe", None)
    current = read() if read is not None else None
    if current is None and read is not None:
        return False  # Not made yet.
    started = getattr(current, "_initialized", None)
    if started is None:
        _moved(
            "tensorflow.python.eager.context.context_safe()._initialized",
            "TensorFlow is taken to have started.",
            library="tensorflow",
        )
        return True
    return bool(started)


def function_call_options():
    """The options the `tf.function` calls of this thread run with (their
    Grappler configuration), or `None` after a warning. TensorFlow has no
    public setter of Grappler's memory optimizer for function calls
    (`tf.config.optimizer.set_experimental_options` has none). Checked:
    `tensorflow.python.eager.context.context().function_call_options`."""
    from tensorflow.python.eager import context

    options = getattr(context.context(), "function_call_options", None)
    if options is None:
        _moved(
            "tensorflow.python.eager.context.Context.function_call_options",
            "Grappler's AddN rewrite stays on: a step that runs out of "
            "memory may make later steps raise AlreadyExistsError.",
            library="tensorflow",
        )
    return options


def set_function_call_options(options) -> None:
    """Sets the options of this thread's `tf.function` calls: ones
    `function_call_options` returned, or `make_function_call_options`
    made."""
    from tensorflow.python.eager import context

    context.context().function_call_options = options


def make_function_call_options(executor_type, config):
    """Function call options from a `ConfigProto`. Checked:
    `tensorflow.python.eager.context.FunctionCallOptions`."""
    from tensorflow.python.eager import context

    return context.FunctionCallOptions(
        executor_type=executor_type, config_proto=config
    )


def stop_recording():
    """A context in which no gradient tape records, as `tf.recompute_grad`
    pauses them; `None` where TensorFlow moved it. (`GradientTape.
    stop_recording` pauses one tape, not the ones Keras' step holds.)
    Checked: `tensorflow.python.eager.record.stop_recording`."""
    stop = _from(
        "tensorflow.python.eager.record",
        "stop_recording",
        "`Checkpointed` layers keep their activations.",
        library="tensorflow",
    )
    return None if stop is None else stop()


def num_workers(strategy) -> int:
    """The workers of a `tf.distribute` strategy's job (1 outside a
    multi-worker one). TensorFlow says so publicly only through a cluster
    resolver's spec, which a strategy made without one lacks. Checked:
    `extended._num_workers`; gone: the cluster resolver's workers."""
    import tensorflow as tf

    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return 1
    count = getattr(strategy.extended, "_num_workers", None)
    if count is not None:
        return int(count)
    _moved(
        "Strategy.extended._num_workers",
        "the cluster resolver's workers are counted instead.",
        library="tensorflow",
    )
    return max(1, _resolver_workers(strategy))


def report_error_to_cluster(code, message: str) -> None:
    """Tells the other workers of this multi-worker job, through
    TensorFlow's coordination service, that this one stops with `code`
    and `message`. No public API reaches the service. Checked:
    `tensorflow.python.eager.context.context().report_error_to_cluster`;
    gone: nothing is sent, and the others learn of it from the missing
    heartbeats instead. Raises what TensorFlow raises when the job has no
    coordination service."""
    from tensorflow.python.eager import context

    report = getattr(context.context(), "report_error_to_cluster", None)
    if report is None:
        _moved(
            "tensorflow.python.eager.context.context().report_error_to_cluster",
            "the other workers learn of the error from missing heartbeats.",
            library="tensorflow",
        )
        return
    report(code, message)


def configure_coordination_service(
    cluster_spec, heartbeat_timeout_s: int
) -> bool:
    """Configures this process's coordination service as
    `MultiWorkerMirroredStrategy` does (leader, chief and worker jobs),
    with a heartbeat timeout of `heartbeat_timeout_s` instead of
    TensorFlow's default 10 s; the strategy made next keeps it. Only the
    strategy's own code reaches the service's settings. Checked:
    `tensorflow.python.eager.context.context().configure_coordination_service`
    and `.coordination_service`; gone: TensorFlow's default stays. Returns
    whether the timeout was set: not where the service is configured
    already or `cluster_spec` has neither a chief nor a worker job."""
    from tensorflow.python.eager import context

    ctx = context.context()
    configure = getattr(ctx, "configure_coordination_service", None)
    if configure is None or not hasattr(ctx, "coordination_service"):
        _moved(
            "tensorflow.python.eager.context.context()"
            ".configure_coordination_service",
            "the coordination service keeps TensorFlow's heartbeat timeout.",
            library="tensorflow",
        )
        return False
    jobs = [job for job in ("chief", "worker") if job in cluster_spec.jobs]
    if ctx.coordination_service is not None or not jobs:
        # Configured already, or no job the strategy would coordinate.
        return False
    configure(
        service_type="standalone",
        service_leader=f"/job:{jobs[0]}/replica:0/task:0",
        heartbeat_timeout_in_ms=heartbeat_timeout_s * 1000,
    )
    for job in jobs:
        ctx.coordination_service.coordinated_job_list.add(
            name=job, num_tasks=cluster_spec.num_tasks(job)
        )
    return True


def cross_replica(function):
    """`function(strategy)` once for every replica of this worker, in a
    `merge_call`, which TensorFlow orders after the control dependencies
    open in each replica; or, where the strategy's step makes no
    `merge_call` (XLA on GPUs only), in each replica, as Keras' optimizer
    updates are. The public `ReplicaContext.merge_call` raises there.
    Checked:
    `tensorflow.python.distribute.merge_call_interim.maybe_merge_call`
    (`tf.__internal__.distribute.interim`), which Keras' optimizer uses;
    gone: in each replica (a marker set there says less than it could,
    never more)."""
    import tensorflow as tf

    strategy = tf.distribute.get_strategy()
    call = _from(
        "tensorflow.python.distribute.merge_call_interim",
        "maybe_merge_call",
        "a step-guard marker is set by each replica on its own.",
        library="tensorflow",
    )
    if call is None:
        return function(strategy)
    return call(function, strategy)


@contextlib.contextmanager
def recording_custom_gradients(names: list):
    """A context that adds to `names` the gradient functions that
    `tf.custom_gradient` registers for graphs traced inside it.

    TensorFlow registers one per call traced in a graph and never drops
    it; it holds the traced graph, and the graph holds every variable it
    captured (Keras' optimizer makes one in each `apply`, through
    `ReplicaContext.all_reduce`). Dropped by `forget_custom_gradients`
    once the graph is no longer run, its variables are freed with their
    last reference. A graph traced inside, by this or another thread, must
    not be differentiated again after that. No public API lists or drops
    them. Checked:
    `tensorflow.python.framework.ops._gradient_registry._registry`, names
    `"CustomGradient-<uid>"` (TensorFlow 2.21); gone: nothing is recorded
    (said in a warning), and what those graphs captured stays allocated.
    """
    registry = _gradient_registry()
    before = None if registry is None else set(list(registry))
    try:
        yield
    finally:
        if registry is not None:
            # `list` copies the keys at once, beside another thread's
            # registration.
            names.extend(
                name
                for name in list(registry)
                if name not in before and name.startswith("CustomGradient-")
            )


def forget_custom_gradients(names: list) -> None:
    """Drops the gradient functions `recording_custom_gradients` recorded
    (their graphs must not be differentiated again), and empties
    `names`."""
    registry = _gradient_registry()
    for name in names:
        if registry is not None:
            registry.pop(name, None)
    names.clear()


def _gradient_registry():
    ops = _from(
        "tensorflow.python.framework.ops",
        "_gradient_registry",
        "the gradient sums of every split stay allocated until the process "
        "ends.",
        library="tensorflow",
    )
    registry = getattr(ops, "_registry", None)
    if ops is not None and not isinstance(registry, dict):
        _moved(
            "tensorflow.python.framework.ops._gradient_registry._registry",
            "the gradient sums of every split stay allocated until the "
            "process ends.",
            library="tensorflow",
        )
        return None
    return registry


# tf.data's own: it has no public walk of a pipeline's transformations,
# and keeps what each was made from, and with, under private attributes.
# Checked on TensorFlow 2.16 and 2.21.


def dataset_inputs(dataset) -> list:
    """The datasets a `tf.data` transformation reads; none for a source.
    Checked: `_input_dataset` (one input), `_datasets` (`zip`,
    `concatenate`, `choose_from_datasets`); gone: `[]`, after a warning,
    and every pipeline is read as if it were its last transformation."""
    import tensorflow as tf

    if not _dataset_walk_works():
        return []
    inputs = getattr(dataset, "_datasets", None)
    found = list(tf.nest.flatten(inputs)) if inputs else []
    parent = getattr(dataset, "_input_dataset", None)
    if parent is not None:
        found.append(parent)
    return found


@functools.cache
def _dataset_walk_works() -> bool:
    import tensorflow as tf

    source = tf.data.Dataset.range(2)
    if getattr(source.batch(1), "_input_dataset", None) is None:
        _moved(
            "tf.data.Dataset._input_dataset",
            "batched pipelines are not recognised: pass batches through "
            "`batch_size=None` and unbatched data with `batch_size`.",
            library="tensorflow",
        )
        return False
    return True


def transformation_argument(dataset, name: str):
    """An argument a `tf.data` transformation was made with:
    `batch_size` and `drop_remainder` of a batching, `buffer_size` of a
    prefetch. Checked: the attribute `_<name>`; gone: `None`, after a
    warning, and what it would tell is taken as unknown."""
    value = getattr(dataset, f"_{name}", None)
    if value is None:
        _moved(
            f"{type(dataset).__name__}._{name}",
            "it is taken as unknown.",
            library="tensorflow",
        )
    return value


# Keras' own, for `AccumulatingModel` built as `Model(inputs, outputs)`
# and its config.


def functional_class():
    """The class of functional models. `keras.Model(inputs, outputs)`
    returns one, but Keras does not export the class, and a subclass
    built functionally must mix it in (as `keras.Model.__new__` does) and
    be told apart from one that is not. Checked:
    `keras.src.models.functional.Functional`; gone: `None`, and an
    `AccumulatingModel` cannot be built functionally (it says so)."""
    return _from(
        "keras.src.models.functional",
        "Functional",
        "an AccumulatingModel cannot be built as Model(inputs, outputs).",
    )


def save_under_name(cls, name: str) -> None:
    """Makes Keras save objects of `cls` under the registered `name`,
    without loading that name back as `cls`. The public
    `keras.saving.register_keras_serializable` maps both ways, which
    would make loading build `cls` instead of the registered class.
    Checked: `keras.src.saving.object_registration.GLOBAL_CUSTOM_NAMES`;
    gone: saved under its own name, so loading needs it in
    `custom_objects` (said in the warning)."""
    names = _from(
        "keras.src.saving.object_registration",
        "GLOBAL_CUSTOM_NAMES",
        f"a functional {cls.__name__} is saved under its own name, and "
        "loading it needs `custom_objects`.",
    )
    if names is not None:
        names[cls] = name


def keras_default(method):
    """`method` marked as Keras marks a method it may replace with its
    own (its automatic `get_config`, the `__init__` arguments, kept when
    a subclass overrides the method). Checked:
    `keras.src.utils.python_utils.default`; gone: unmarked (said in a
    warning), so Keras takes the override as the whole config."""
    mark = _from(
        "keras.src.utils.python_utils",
        "default",
        "a subclass's own `__init__` arguments may be left out of its config.",
    )
    return method if mark is None else mark(method)


def _from(module: str, name: str, consequence: str, library: str = "keras"):
    """`module.name`, or `None` after a warning that `library` moved it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        _moved(f"{module}.{name}", consequence, library=library)
        return None
