"""The user's data, one class per kind, at any batch size.

`fit`, `evaluate`, `predict` and `find_max_batch_size` take arrays, an
unbatched `tf.data.Dataset`, a batched one, or a callable
`batch_size -> tf.data.Dataset`. `source_for` picks the class for the data
it is given; every class answers the same questions: the arguments for
`model.fit`, `evaluate` and `predict` at a batch size, the validation
arguments, the arguments of a short trial, the sample count, inputs to
build the model with, and the number of batches.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfmemsafe import _arrays
from tfmemsafe import _checks
from tfmemsafe import _pipelines
from tfmemsafe import memory
from tfmemsafe.distribute import is_multi_worker

# Keras' default batch size, used for arrays and unbatched datasets.
DEFAULT_BATCH_SIZE = 32


def source_for(data, argument: str, *, labelled: bool, strategy=None) -> Source:
    """The source for `data`, passed as `argument`.

    Args:
        data: The user's data.
        argument: str. The name the user passed it as, for messages.
        labelled: bool. Whether arrays come as `(x, y[, sample_weight])`
            (training and evaluation) rather than inputs alone (predict).
        strategy: The model's `tf.distribute.Strategy`. Where it reads
            its data on one worker (`MirroredStrategy`, `OneDeviceStrategy`,
            a `MultiWorkerMirroredStrategy` of one worker), the pipelines
            given to Keras are not sharded (`_pipelines.for_keras`).

    Raises:
        TypeError: If `data` is of no accepted kind.
    """
    source = _source_for(data, argument, labelled)
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        source.one_worker = not is_multi_worker(strategy)
    else:
        # Not a TPUStrategy, whose pod reads on several hosts.
        source.one_worker = isinstance(
            strategy,
            (tf.distribute.MirroredStrategy, tf.distribute.OneDeviceStrategy),
        )
    return source


def _source_for(data, argument: str, labelled: bool) -> Source:
    if isinstance(data, tf.data.Dataset):
        batched, batch_size = _pipelines.batching_of(data)
        if batched:
            return BatchedDataset(data, argument, batch_size)
        return UnbatchedDataset(data, argument)
    if callable(data):
        return DatasetCallable(data, argument)
    if labelled and _is_labelled_arrays(data):
        return Arrays(data, argument, labelled=True)
    if not labelled and _is_arrays(data):
        return Arrays(data, argument, labelled=False)
    arrays = "(x, y) or (x, y, sample_weight)" if labelled else "x"
    raise TypeError(
        f"`{argument}` must be a callable `batch_size -> "
        "tf.data.Dataset`, a tf.data.Dataset, or arrays "
        f"{arrays}. Received: {argument}={data!r:.80} of type "
        f"{type(data).__name__}"
    )


class Source:
    """Data of one kind, at any batch size: the questions each kind answers.

    Attributes:
        data: The user's data, as given.
        argument: str. The name it was passed as, for messages.
        batch_size: int or `None`. The size a batched dataset comes in;
            `None` for the other kinds, or when it cannot be read.
        one_worker: bool. Whether the job is known to run on one worker:
            then nothing shards the pipelines.
    """

    one_worker = False

    def __init__(self, data, argument: str, batch_size: int | None = None):
        self.data = data
        self.argument = argument
        self.batch_size = batch_size
        self._signature = None
        self._sample = None

    def resolve_batch_size(self, batch_size: int | None) -> int:
        """The `batch_size` argument, or this data's default for `None`."""
        if batch_size is None:
            return self.default_batch_size()
        return _checks.integer("batch_size", batch_size, 1)

    def default_batch_size(self) -> int:
        return DEFAULT_BATCH_SIZE

    @property
    def num_samples(self) -> int | None:
        """The number of samples, if known without reading the data."""
        return None

    def dataset(self, batch_size: int, *, repeat: bool = False):
        """The data as a dataset of batches of `batch_size`."""
        raise NotImplementedError

    def trial_arguments(self, batch_size: int, steps: int) -> dict:
        """Arguments for `model.fit` to train `steps` full batches."""
        batches = self.dataset(batch_size, repeat=True).take(steps)
        return {
            # Told its length, which `rebatch` hides: Keras warns of data
            # that ran out at the end of one of unknown length.
            "x": batches.apply(tf.data.experimental.assert_cardinality(steps)),
            "shuffle": False,
        }

    def resident_bytes(self) -> int:
        """What the data itself keeps in host memory while training: in
        the allocator's statistics, beside every step."""
        return 0  # A pipeline streams its batches.

    def resident_bytes_now(self) -> int:
        """Of `resident_bytes`, what is in the allocator now."""
        return 0

    def sample_inputs(self):
        """The inputs of one sample, as a batch of one, to build a model.

        Read once: every read starts the pipeline again (a `shuffle` fills
        its whole buffer first: 0.45 s a read of 20,000 sequences), and
        one sample is what every caller wants.
        """
        if self._sample is None:
            self._sample = self._read_sample_inputs()
        return self._sample

    def _read_sample_inputs(self):
        batch = next(iter(self.dataset(1).take(1)))
        x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
        return x

    def sample_signature(self) -> tuple:
        """The shapes (without the batch) and dtypes of one sample.

        What a measured batch size is known to fit is known for data of
        this signature.
        """
        if self._signature is None:
            self._signature = self._read_signature()
        return self._signature

    def _read_signature(self) -> tuple:
        spec = self.dataset(1).element_spec
        return tuple(
            (tuple(s.shape.as_list()[1:]), s.dtype.name)
            for s in tf.nest.flatten(spec)
        )


class Arrays(Source):
    """Arrays: `(x, y[, sample_weight])`, or the inputs `x` alone."""

    def __init__(self, data, argument: str, *, labelled: bool):
        super().__init__(data, argument)
        self.labelled = labelled
        if labelled:
            self.x, self.y, self.sample_weight = (*data, None)[:3]
        else:
            self.x, self.y, self.sample_weight = data, None, None
        self._tensors = None
        self._allocated = 0  # Of the tensors, the bytes in the allocator.
        _arrays.check_cardinality(
            argument,
            {"x": self.x, "y": self.y, "sample_weight": self.sample_weight},
        )

    @property
    def num_samples(self) -> int:
        return _arrays.num_rows(self.x)

    def tensors(self):
        """The arrays as host tensors, converted once for the whole run.

        Keras' array adapter converts `x`, `y` and `sample_weight` to
        tensors at the start of every `model.fit`, `evaluate` and
        `predict` call (floats cast to `floatx`). The memory estimate's
        probes, `find_max_batch_size`'s trials and the planner's
        measurements call `fit` at several batch sizes, so the arrays are
        converted here, once, the same way, and each call gathers its
        batches from these tensors by index: nothing is converted between
        a trial that ran out of memory and the next, where a
        host-to-device conversion that fails for lack of memory ends the
        process inside TensorFlow instead of raising.

        Returns:
            `(x, y, sample_weight)` as tensors (`y` and `sample_weight`
            possibly `None`), or `None` when a leaf is of a kind Keras
            slices itself (sparse or ragged tensors, SciPy matrices):
            those are passed to Keras as arrays.
        """
        if self._tensors is None:
            parts = (self.x, self.y, self.sample_weight)
            leaves = keras.tree.flatten(parts)
            if not all(
                leaf is None or _arrays.is_dense(leaf) for leaf in leaves
            ):
                self._tensors = False
            else:
                before = _allocated_bytes()
                with tf.device("CPU:0"):
                    tensors = tuple(
                        None
                        if part is None
                        else keras.tree.map_structure(
                            _arrays.host_tensor,
                            keras.tree.lists_to_tuples(part),
                        )
                        for part in parts
                    )
                # What the conversion added to the allocator: a tensor may
                # use NumPy's buffer in place, outside it (an aligned
                # array of a dtype kept as it is), or copy it in. Without
                # statistics, all of them.
                after = _allocated_bytes()
                if before is None or after is None:
                    self._allocated = self.resident_bytes()
                else:
                    self._allocated = max(after - before, 0)
                self._tensors = tensors
        return self._tensors or None

    def _array_arguments(self, batch_size) -> dict:
        """The arrays themselves, for Keras to convert and slice."""
        return {
            "x": self.x,
            "y": self.y,
            "sample_weight": self.sample_weight,
            "batch_size": batch_size,
        }

    def trial_arguments(self, batch_size: int, steps: int) -> dict:
        # Batches of the whole arrays, not of a slice: training holds them
        # all, and the trial must need what training will.
        tensors = self.tensors()
        if tensors is not None:
            batches = _arrays.cycled(
                tensors, batch_size, steps, one_worker=self.one_worker
            )
            return {"x": batches, "shuffle": False}
        arguments = self._array_arguments(batch_size)
        arguments.update(shuffle=False, steps_per_epoch=steps)
        return arguments

    def resident_bytes(self) -> int:
        # Their tensors (`tensors`) stay for the whole run, floats cast to
        # `floatx`, except where a tensor uses NumPy's buffer in place
        # (outside the allocator). Before they are converted, all of them
        # (a conversion may copy), counted without converting: tracing the
        # static bound just after an error must not convert. Leaves that
        # Keras converts itself are in memory through each of its calls.
        if self._tensors:
            return self._allocated
        leaves = keras.tree.flatten((self.x, self.y, self.sample_weight))
        return sum(
            _arrays.tensor_bytes(leaf) for leaf in leaves if leaf is not None
        )

    def resident_bytes_now(self) -> int:
        # Keras' own conversions last one call; tensors not made yet hold
        # nothing.
        return self._allocated if self._tensors else 0

    def _read_sample_inputs(self):
        return keras.tree.map_structure(lambda a: a[:1], self.x)

    def _read_signature(self) -> tuple:
        leaves = keras.tree.flatten((self.x, self.y, self.sample_weight))
        return tuple(
            (tuple(leaf.shape[1:]), str(getattr(leaf, "dtype", "")))
            for leaf in leaves
            if leaf is not None
        )


class UnbatchedDataset(Source):
    """A `tf.data.Dataset` of single samples: batched and prefetched here."""

    @property
    def num_samples(self) -> int | None:
        cardinality = int(self.data.cardinality())
        return cardinality if cardinality >= 0 else None

    def dataset(self, batch_size: int, *, repeat: bool = False):
        dataset = self.data.repeat() if repeat else self.data
        return _pipelines.for_keras(
            dataset.batch(batch_size), one_worker=self.one_worker
        )


class BatchedDataset(Source):
    """A `tf.data.Dataset` of batches: rebatched at other sizes."""

    def default_batch_size(self) -> int:
        if self.batch_size is None:
            raise ValueError(
                "`batch_size` is required: the batch size of "
                f"`{self.argument}` could not be read from its "
                "pipeline (a `bucket_by_sequence_length` pipeline has "
                "several: give `tfmemsafe.fit` the unbatched examples "
                "with batch_size='auto' instead). Received: batch_size=None"
            )
        return self.batch_size

    @property
    def num_samples(self) -> int | None:
        return _pipelines.rows_of_batched(self.data)

    def _read_sample_inputs(self):
        # A row of the first batch: no batching again (examples of varying
        # length cannot be).
        batch = next(iter(self.data.take(1)))
        x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
        return tf.nest.map_structure(lambda t: t[:1], x)

    def _read_signature(self) -> tuple:
        return tuple(
            (tuple(s.shape.as_list()[1:]), s.dtype.name)
            for s in tf.nest.flatten(self.data.element_spec)
        )

    def dataset(self, batch_size: int, *, repeat: bool = False):
        if batch_size == self.batch_size and not repeat:
            # The user's pipeline, as it is but for its end.
            return _pipelines.for_keras(self.data, one_worker=self.one_worker)
        if _pipelines.padded_to_each_batch(self.data.element_spec):
            raise ValueError(
                f"`{self.argument}` is batched, and its examples vary in "
                f"length (`padded_batch`), so it cannot be batched again at "
                f"{batch_size} to measure it. Pass the unbatched examples "
                "instead: `tfmemsafe.fit(..., batch_size='auto')` batches "
                "them by length buckets. Received: a dataset of batches of "
                f"{self.data.element_spec}"
            )
        dataset = self.data.repeat() if repeat else self.data
        dataset = _pipelines.rebatched(dataset, batch_size)
        return _pipelines.for_keras(dataset, one_worker=self.one_worker)


class DatasetCallable(Source):
    """A callable `batch_size -> tf.data.Dataset`: the user's pipeline."""

    def default_batch_size(self) -> int:
        raise ValueError(
            f"`batch_size` is required when `{self.argument}` is a "
            "callable: it is the size your pipeline is built at. "
            "Received: batch_size=None"
        )

    def dataset(self, batch_size: int, *, repeat: bool = False):
        dataset = self.data(batch_size)
        if not isinstance(dataset, tf.data.Dataset):
            raise TypeError(
                f"`{self.argument}` must return a tf.data.Dataset when "
                f"called with a batch size. Received: "
                f"{self.argument}({batch_size}) = {dataset!r:.80}"
            )
        if repeat:
            dataset = dataset.repeat()
        return _pipelines.for_keras(dataset, one_worker=self.one_worker)


def _allocated_bytes() -> int | None:
    """The bytes in use in CPU:0's allocator, or `None` without statistics."""
    return memory.memory_info("CPU:0", include_limit=False).current_bytes


def _is_arrays(x) -> bool:
    leaves = keras.tree.flatten(x)
    return bool(leaves) and all(hasattr(leaf, "shape") for leaf in leaves)


def _is_labelled_arrays(data) -> bool:
    return (
        isinstance(data, (tuple, list))
        and len(data) in (2, 3)
        and _is_arrays(data[0])
        and all(part is None or _is_arrays(part) for part in data[1:])
    )
