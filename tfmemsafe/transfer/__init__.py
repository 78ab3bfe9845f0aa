"""Transfer learning on little memory: a frozen MobileNetV2 and its features.

Owns `build_frozen_mobilenet_v2` (a frozen backbone with a new head, as
an `AccumulatingModel`), `InferenceMode` (BatchNormalization kept in
inference even when `fit` says otherwise), `unfreeze` and its
`UnfreezeSummary`, and `cache_features` / `fit_head` (train the head on
the backbone's features computed once).
"""

from tfmemsafe.transfer._backbones import FEATURES_LAYER
from tfmemsafe.transfer._backbones import InferenceMode
from tfmemsafe.transfer._backbones import build_frozen_mobilenet_v2
from tfmemsafe.transfer._feature_cache import cache_features
from tfmemsafe.transfer._feature_cache import fit_head
from tfmemsafe.transfer._imagenet_weights import ALPHAS
from tfmemsafe.transfer._imagenet_weights import IMAGENET_SIZES
from tfmemsafe.transfer._unfreeze import UnfreezeSummary
from tfmemsafe.transfer._unfreeze import unfreeze

__all__ = [
    "ALPHAS",
    "FEATURES_LAYER",
    "IMAGENET_SIZES",
    "InferenceMode",
    "UnfreezeSummary",
    "build_frozen_mobilenet_v2",
    "cache_features",
    "fit_head",
    "unfreeze",
]
