"""Fine-tuning: `unfreeze` makes the top of a frozen backbone trainable."""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
from absl import logging

from tfmemsafe import _checks


@dataclasses.dataclass(frozen=True)
class UnfreezeSummary:
    """What `unfreeze` made trainable.

    Attributes:
        backbone: The backbone's name.
        layers: The names of the backbone layers that are now trainable.
        frozen_batchnorm: BatchNormalization layers in the unfrozen range
            that were kept frozen.
        trainable_params: The number of backbone parameters now trainable.
    """

    backbone: str
    layers: tuple[str, ...]
    frozen_batchnorm: tuple[str, ...]
    trainable_params: int

    def __str__(self) -> str:
        return (
            f"Unfroze {len(self.layers)} layers of {self.backbone!r} "
            f"({self.trainable_params:,} parameters now trainable; "
            f"{len(self.frozen_batchnorm)} BatchNormalization layers kept "
            "frozen). Recompile the model, with a lower learning rate, "
            "before calling fit."
        )


def unfreeze(
    model: keras.Model,
    *,
    last_n_layers: int | None = None,
    from_layer: str | None = None,
    keep_batchnorm_frozen: bool = True,
) -> UnfreezeSummary:
    """Makes the top of a frozen backbone trainable, for fine-tuning.

    The second phase of transfer learning: once the head has been trained
    on the frozen backbone, unfreeze the backbone's last layers and train
    on with a learning rate about 10x lower, so the pretrained filters
    adapt without being wiped out by large gradients.

    The call sets the whole trainable state of the backbone: the layers in
    the range become trainable and all others frozen, so calling it again
    with a smaller range freezes layers again. Layers are counted as in
    `backbone.layers` (activations and additions included), as in the
    Keras fine-tuning guide. BatchNormalization layers are kept frozen by
    default: their statistics suit the pretrained filters, and a model
    from `build_frozen_mobilenet_v2` runs them in inference mode anyway.

    Give at most one of `last_n_layers` and `from_layer`; with neither,
    the whole backbone is unfrozen.

    You must compile the model again after this call (Keras fixes the
    trainable weights at `compile`), with a lower learning rate:
    `model.compile(optimizer=keras.optimizers.Adam(1e-5), ...)`.

    Args:
        model: A model from `build_frozen_mobilenet_v2`, or any model with
            one nested model that has weights (its backbone, possibly in a
            wrapper such as `InferenceMode`); a model with no nested model
            is treated as the backbone itself.
        last_n_layers: int. Unfreeze the backbone's last this many layers.
        from_layer: str. Unfreeze from the backbone layer of this name
            (inclusive) to the end, e.g. `"block_13_expand"`.
        keep_batchnorm_frozen: bool. Keep BatchNormalization layers frozen.
            Defaults to `True`.

    Returns:
        An `UnfreezeSummary` naming the layers now trainable and the
        number of backbone parameters that are. It is also logged.

    Raises:
        ValueError: If both `last_n_layers` and `from_layer` are given,
            `last_n_layers` is out of range, `from_layer` names no backbone
            layer, or the backbone cannot be told apart.

    Example:
    >>> summary = tfmemsafe.unfreeze(model, last_n_layers=30)
    >>> model.compile(optimizer=keras.optimizers.Adam(1e-5),
    ...               loss="sparse_categorical_crossentropy")
    """
    backbone = _find_backbone(model)
    layers = [
        layer
        for layer in backbone.layers
        if not isinstance(layer, keras.layers.InputLayer)
    ]
    start = _unfreeze_start(layers, backbone.name, last_n_layers, from_layer)
    backbone.trainable = True
    unfrozen, frozen_batchnorm = [], []
    for i, layer in enumerate(layers):
        is_batchnorm = isinstance(layer, keras.layers.BatchNormalization)
        if i >= start and is_batchnorm and keep_batchnorm_frozen:
            frozen_batchnorm.append(layer.name)
        layer.trainable = i >= start and layer.name not in frozen_batchnorm
        if layer.trainable:
            unfrozen.append(layer.name)
    trainable_params = sum(
        int(np.prod(w.shape)) for w in backbone.trainable_weights
    )
    summary = UnfreezeSummary(
        backbone=backbone.name,
        layers=tuple(unfrozen),
        frozen_batchnorm=tuple(frozen_batchnorm),
        trainable_params=trainable_params,
    )
    logging.info("%s", summary)
    return summary


def _find_backbone(model: keras.Model) -> keras.Model:
    unwrapped = [
        layer.layer if isinstance(layer, keras.layers.Wrapper) else layer
        for layer in model.layers
    ]
    nested = [
        layer
        for layer in unwrapped
        if isinstance(layer, keras.Model) and layer.weights
    ]
    if not nested:
        return model
    if len(nested) > 1:
        raise ValueError(
            "`model` must have one nested model (its backbone) to unfreeze. "
            f"Received: a model with {len(nested)}: "
            f"{', '.join(repr(layer.name) for layer in nested)}. Call "
            "`unfreeze` on the backbone itself."
        )
    return nested[0]


def _unfreeze_start(layers, backbone_name, last_n_layers, from_layer) -> int:
    if last_n_layers is not None and from_layer is not None:
        raise ValueError(
            "Give at most one of `last_n_layers` and `from_layer`. "
            f"Received: last_n_layers={last_n_layers!r}, "
            f"from_layer={from_layer!r}"
        )
    if last_n_layers is not None:
        if not _checks.is_integer(last_n_layers) or last_n_layers > len(layers):
            raise ValueError(
                "`last_n_layers` must be an integer from 1 to the "
                f"backbone's {len(layers)} layers. "
                f"Received: last_n_layers={last_n_layers!r}"
            )
        return len(layers) - last_n_layers
    if from_layer is not None:
        names = [layer.name for layer in layers]
        if from_layer not in names:
            raise ValueError(
                f"`from_layer` must name a layer of the backbone "
                f"{backbone_name!r}, such as {names[-min(10, len(names))]!r}. "
                f"Received: from_layer={from_layer!r}"
            )
        return names.index(from_layer)
    return 0
