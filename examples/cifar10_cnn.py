r"""Trains a CNN from scratch on CIFAR-10 (or digits) without running out.

A VGG-style network (blocks of two 3x3 convolutions with batch
normalization, then max-pooling) is trained through `tfmemsafe.fit`:
before the first step, when its memory estimate predicts that the batch
does not fit (`--preflight`), it starts with the batch split into
micro-batches of one update, and a batch that still runs out is trained
again, in its step, as micro-batches: the batch size, and so each
update, stays the one asked for. `--checkpointing` recomputes the
convolution blocks' activations in the backward pass instead of keeping
them. A `tfmemsafe.MemoryMonitor` records the memory used.

On any machine, no download needed (over 90% test accuracy in about a
minute on two CPU cores):

    python examples/cifar10_cnn.py --dataset=digits

Watch an out-of-memory error happen and be recovered from, on a CPU:

    python examples/cifar10_cnn.py --dataset=digits --batch_size=256 \
        --memory_cap_mb=240

CIFAR-10 itself (downloaded by tensorflow_datasets the first time), with
updates of 256 samples made of two batches of 128:

    python examples/cifar10_cnn.py --epochs=30 --accumulation_steps=2

With TF_CONFIG set on each machine, the same command trains as one worker
of a MultiWorkerMirroredStrategy job: worker 0 writes the outputs and backs
up every epoch, so a job restarted after a failure (say, at a smaller
--batch_size after running out of memory) resumes. See
docs/multi-worker.md.
"""

import math
import os

import common
import keras
from absl import app
from absl import flags

import tfmemsafe

# --help lists the flags every example takes, too.
flags.adopt_module_key_flags(common)

_FILTERS = flags.DEFINE_list(
    "filters",
    ["32", "64", "128"],
    "Filters of each convolution block; each block halves the image side.",
)
_LEARNING_RATE = flags.DEFINE_float(
    "learning_rate",
    1e-3,
    "Adam's learning rate in the first epoch; it decays along a cosine to "
    "near 0 in the last.",
    lower_bound=0.0,
)
_CHECKPOINTING = flags.DEFINE_boolean(
    "checkpointing",
    False,
    "Recompute the activations of every convolution block but the last in "
    "the backward pass instead of keeping them (gradient checkpointing): "
    "less memory, one more forward pass per step.",
)

_NUM_CLASSES = 10


def build_model(
    input_shape: tuple[int, int, int],
    filters: list[int],
    *,
    accumulation_steps: int = 1,
    checkpointing: bool = False,
) -> tfmemsafe.AccumulatingModel:
    """A VGG-style CNN that takes uint8 images and returns logits."""
    blocks = [
        keras.Sequential(
            [
                keras.layers.Conv2D(f, 3, padding="same", use_bias=False),
                keras.layers.BatchNormalization(momentum=0.9),
                keras.layers.ReLU(),
                keras.layers.Conv2D(f, 3, padding="same", use_bias=False),
                keras.layers.BatchNormalization(momentum=0.9),
                keras.layers.ReLU(),
                keras.layers.MaxPooling2D(),
            ],
            name=f"block_{i}",
        )
        for i, f in enumerate(filters)
    ]
    if checkpointing:
        # Every block but the last, which the backward pass starts with.
        blocks = tfmemsafe.checkpoint_blocks(blocks, segments=len(blocks))
    inputs = keras.Input(input_shape, dtype="uint8", name="images")
    x = keras.layers.Rescaling(1 / 255)(inputs)
    for block in blocks:
        x = block(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dropout(0.3)(x)
    # float32 logits keep the loss stable under mixed precision.
    outputs = keras.layers.Dense(_NUM_CLASSES, dtype="float32")(x)
    return tfmemsafe.AccumulatingModel(
        inputs,
        outputs,
        accumulation_steps=accumulation_steps,
        name="cifar10_cnn",
    )


def _filters() -> list[int]:
    try:
        filters = [int(f) for f in _FILTERS.value]
    except ValueError:
        filters = []
    if not filters or min(filters) < 1:
        raise app.UsageError(
            "--filters must be a comma-separated list of positive integers. "
            f"Received: --filters={','.join(_FILTERS.value)}"
        )
    if len(filters) > 5:
        raise app.UsageError(
            "--filters can list at most 5 blocks: each halves the 32x32 "
            f"image. Received: --filters={','.join(_FILTERS.value)}"
        )
    return filters


def main(argv):
    filters = _filters()
    setup = common.set_up(__file__, argv)
    if setup is None:  # It ran under --memory_cap_mb.
        return

    train = common.load("train", augment=True)
    test = common.load("test")
    with common.distribution_strategy().scope():
        model = build_model(
            train.element_spec[0].shape,
            filters,
            accumulation_steps=common.ACCUMULATION_STEPS.value,
            checkpointing=_CHECKPOINTING.value,
        )
        model.compile(
            optimizer=keras.optimizers.Adam(_LEARNING_RATE.value),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    monitor, callbacks = common.callbacks(
        setup.directory, backup_dir=setup.backup_dir
    )
    # Cosine decay by epoch: whatever batch size the run ends up with, the
    # last epochs settle at a small learning rate.
    callbacks.append(
        keras.callbacks.LearningRateScheduler(
            lambda epoch: (
                _LEARNING_RATE.value
                * 0.5
                * (1 + math.cos(math.pi * epoch / common.EPOCHS.value))
            )
        )
    )
    history = tfmemsafe.fit(
        model,
        train,
        batch_size=setup.batch_size,
        epochs=common.EPOCHS.value,
        steps_per_epoch=common.STEPS_PER_EPOCH.value,
        preflight=common.PREFLIGHT.value,
        validation_data=test,
        callbacks=callbacks,
        # The pipeline shuffles every epoch already.
        shuffle=False,
    )
    loss, accuracy = tfmemsafe.evaluate(
        model, test, batch_size=history.batch_size, verbose=0
    )
    model_path = os.path.join(setup.directory, "model.keras")
    model.save(model_path)
    common.summarize(
        setup.directory,
        results={"test accuracy": accuracy, "test loss": loss},
        runs=[common.Run("training", history, monitor)],
        outputs=[model_path, os.path.join(setup.directory, "history.csv")],
        started=setup.started,
    )


if __name__ == "__main__":
    app.run(main)
