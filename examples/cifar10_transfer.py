r"""Transfer learning on CIFAR-10 (or digits) with a frozen MobileNetV2.

Phase 1 trains a classifier head on a frozen MobileNetV2 backbone, which
needs no gradients and keeps no activations for the backward pass, so it
fits where full training does not. With `--cache_features` the backbone
runs once over the data and the head trains on the stored features, at a
tiny fraction of the time and memory per epoch. Phase 2
(`--fine_tune_epochs`) unfreezes the backbone's top layers and trains on
at a lower learning rate; it needs several times the memory, and
`tfmemsafe.fit` starts a batch predicted not to fit already split into
micro-batches of one update, and splits one that still runs out.

With ImageNet weights (downloaded by Keras the first time), images are
upsampled to 96x96, the smallest size the weights were trained at:

    python examples/cifar10_transfer.py --epochs=5 --fine_tune_epochs=5

Without network access, pass a weights file downloaded elsewhere
(`--weights=/path/to/mobilenet_v2_..._no_top.h5`), or train from random
weights to try the mechanics (the frozen features are then meaningless):

    python examples/cifar10_transfer.py --dataset=digits --weights=none \
        --alpha=0.35 --resize_to=32 --cache_features --fine_tune_epochs=3
"""

import os

import common
import keras
from absl import app
from absl import flags

import tfmemsafe
from tfmemsafe import transfer

# --help lists the flags every example takes, too.
flags.adopt_module_key_flags(common)

_WEIGHTS = flags.DEFINE_string(
    "weights",
    "imagenet",
    "imagenet (downloaded by Keras the first time), none (random "
    "initialisation), or the path of a MobileNetV2 no-top weights file.",
)
_ALPHA = flags.DEFINE_enum(
    "alpha",
    "1.0",
    [str(alpha) for alpha in transfer.ALPHAS],
    "MobileNetV2's width multiplier.",
)
_RESIZE_TO = flags.DEFINE_integer(
    "resize_to",
    96,
    "Side in pixels the images are resized to inside the model. ImageNet "
    "weights exist for 96, 128, 160, 192 and 224; memory grows with the "
    "square of the side.",
    lower_bound=32,
)
_HEAD_LEARNING_RATE = flags.DEFINE_float(
    "head_learning_rate",
    1e-3,
    "Adam's learning rate while the backbone is frozen.",
    lower_bound=0.0,
)
_CACHE_FEATURES = flags.DEFINE_boolean(
    "cache_features",
    False,
    "Run the frozen backbone once and train the head on the stored "
    "features (no augmentation).",
)
_AUGMENT = flags.DEFINE_boolean(
    "augment",
    None,
    "Random crops (and flips for CIFAR-10) of the training images. "
    "Defaults to on, except with --cache_features.",
)
_FINE_TUNE_EPOCHS = flags.DEFINE_integer(
    "fine_tune_epochs",
    0,
    "Epochs of fine-tuning after the head is trained; 0 skips it.",
    lower_bound=0,
)
_FINE_TUNE_LAYERS = flags.DEFINE_integer(
    "fine_tune_layers",
    30,
    "How many of the backbone's last layers to unfreeze for fine-tuning "
    "(BatchNormalization stays frozen); 0 unfreezes all of them.",
    lower_bound=0,
)
_FINE_TUNE_LEARNING_RATE = flags.DEFINE_float(
    "fine_tune_learning_rate",
    1e-4,
    "Adam's learning rate for fine-tuning, 10x lower than the head's so "
    "that the pretrained filters are not wiped out.",
    lower_bound=0.0,
)

_NUM_CLASSES = 10
_FINE_TUNE_FLAGS = (_FINE_TUNE_LAYERS, _FINE_TUNE_LEARNING_RATE)


def _check_flags() -> None:
    if _CACHE_FEATURES.value and _AUGMENT.value:
        raise app.UsageError(
            "--augment cannot be used with --cache_features: the features "
            "are computed once, so every epoch would see the same "
            "augmented images. Drop one of them."
        )
    if _CACHE_FEATURES.value and common.batch_size() == "auto":
        raise app.UsageError(
            "--batch_size=auto searches for the largest batch that trains "
            "through tfmemsafe.fit; with --cache_features the head trains "
            "on features instead. Pass a number, e.g. --batch_size=256."
        )
    if not _FINE_TUNE_EPOCHS.value:
        for holder in _FINE_TUNE_FLAGS:
            if not flags.FLAGS[holder.name].using_default_value:
                raise app.UsageError(
                    f"--{holder.name} only applies to fine-tuning; also "
                    "pass --fine_tune_epochs=N (N > 0)."
                )


def _augment() -> bool:
    if _AUGMENT.value is None:
        return not _CACHE_FEATURES.value
    return _AUGMENT.value


def _weights() -> str | None:
    value = _WEIGHTS.value
    if value.lower() == "none":
        return None
    if value == "imagenet" or os.path.isfile(value):
        return value
    raise app.UsageError(
        "--weights must be imagenet, none or the path of an existing "
        f"weights file. Received: --weights={value}"
    )


def build_model(input_shape, weights) -> tfmemsafe.AccumulatingModel:
    """The frozen MobileNetV2 classifier, with gradient accumulation."""
    try:
        model = tfmemsafe.build_frozen_mobilenet_v2(
            input_shape,
            _NUM_CLASSES,
            weights=weights,
            alpha=float(_ALPHA.value),
            resize_to=_RESIZE_TO.value,
        )
    except RuntimeError as err:  # The ImageNet weights could not be fetched.
        raise SystemExit(
            f"error: {err} (flags: --weights=none or --weights=PATH)"
        ) from err
    return tfmemsafe.with_gradient_accumulation(
        model, common.ACCUMULATION_STEPS.value
    )


def _compile(model, learning_rate) -> None:
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )


def _train_head(model, batch_size, directory) -> common.Run:
    """Phase 1: the head on the frozen backbone, on features or images."""
    monitor, callbacks = common.callbacks(directory)
    if _CACHE_FEATURES.value:
        print("Computing the backbone's features once.", flush=True)
        extraction = tfmemsafe.cache_features(
            model, common.load("train").batch(batch_size)
        )
        test_features = tfmemsafe.cache_features(
            model, common.load("test").batch(batch_size)
        )
        history = tfmemsafe.fit_head(
            model,
            extraction,
            epochs=common.EPOCHS.value,
            # Memory is no concern on features: one batch per update.
            batch_size=batch_size * model.accumulation_steps,
            validation_data=test_features,
            callbacks=callbacks,
        )
    else:
        history = tfmemsafe.fit(
            model,
            common.load("train", augment=_augment()),
            batch_size=batch_size,
            epochs=common.EPOCHS.value,
            steps_per_epoch=common.STEPS_PER_EPOCH.value,
            preflight=common.PREFLIGHT.value,
            validation_data=common.load("test"),
            callbacks=callbacks,
            shuffle=False,  # The pipeline shuffles every epoch already.
        )
    return common.Run("frozen backbone", history, monitor)


def _fine_tune(model, batch_size, directory) -> common.Run:
    """Phase 2: unfreezes the top of the backbone and trains on."""
    unfrozen = tfmemsafe.unfreeze(
        model, last_n_layers=_FINE_TUNE_LAYERS.value or None
    )
    print(
        f"Fine-tuning {len(unfrozen.layers)} layers of {unfrozen.backbone} "
        f"({unfrozen.trainable_params:,} parameters; "
        f"{len(unfrozen.frozen_batchnorm)} BatchNormalization layers kept "
        "frozen).",
        flush=True,
    )
    with common.distribution_strategy().scope():
        _compile(model, _FINE_TUNE_LEARNING_RATE.value)
    monitor, callbacks = common.callbacks(directory, append=True)
    history = tfmemsafe.fit(
        model,
        common.load("train", augment=_augment()),
        batch_size=batch_size,
        epochs=common.EPOCHS.value + _FINE_TUNE_EPOCHS.value,
        initial_epoch=common.EPOCHS.value,
        steps_per_epoch=common.STEPS_PER_EPOCH.value,
        preflight=common.PREFLIGHT.value,
        validation_data=common.load("test"),
        callbacks=callbacks,
        shuffle=False,
    )
    return common.Run("fine-tuning", history, monitor)


def main(argv):
    _check_flags()
    weights = _weights()
    setup = common.set_up(__file__, argv)
    if setup is None:  # It ran under --memory_cap_mb.
        return
    batch_size, directory = setup.batch_size, setup.directory

    test = common.load("test")
    with common.distribution_strategy().scope():
        model = build_model(tuple(test.element_spec[0].shape), weights)
        _compile(model, _HEAD_LEARNING_RATE.value)
    runs = [_train_head(model, batch_size, directory)]
    if _FINE_TUNE_EPOCHS.value:
        # Fine-tuning needs more memory, not less: start where phase 1
        # ended, or search again.
        if batch_size != "auto":
            batch_size = getattr(runs[0].history, "batch_size", batch_size)
        runs.append(_fine_tune(model, batch_size, directory))
    final_batch_size = getattr(runs[-1].history, "batch_size", None)
    loss, accuracy = tfmemsafe.evaluate(
        model,
        test,
        batch_size=final_batch_size or batch_size,
        verbose=0,
    )
    model_path = os.path.join(directory, "model.keras")
    model.save(model_path)
    common.summarize(
        directory,
        results={"test accuracy": accuracy, "test loss": loss},
        runs=runs,
        outputs=[model_path, os.path.join(directory, "history.csv")],
        started=setup.started,
    )


if __name__ == "__main__":
    app.run(main)
