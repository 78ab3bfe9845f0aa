"""`checkpoint_blocks`: a chain of blocks, checkpointed in segments."""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Sequence

import keras

from tfmemsafe.checkpointing._checkpointed import Checkpointed


def checkpoint_blocks(
    blocks: Sequence[keras.layers.Layer],
    segments: int | None = None,
    checkpoint_last: bool = False,
) -> list[Checkpointed]:
    """Groups a chain of blocks into segments and checkpoints the segments.

    The sqrt(n) scheme of Chen et al. (2016), "Training Deep Nets with
    Sublinear Memory Cost": of `n` chained blocks, only the inputs of
    about sqrt(n) segments are kept through the forward pass, and each
    segment is recomputed in the backward pass, so activation memory grows
    like sqrt(n) instead of n.

    The last segment is not recomputed by default: the backward pass
    starts with it, so recomputing it would rebuild at once the
    activations it had just freed, costing time and saving nothing. It is
    wrapped in `Checkpointed(..., recompute=False)`, which keeps its
    activations but frees them, with all its gradients, before the
    recomputation of the other segments begins. Set `checkpoint_last=True`
    when large layers follow the blocks (a wide classifier head) and the
    last segment's activations should not wait through them.

    Each block must take one tensor and return one tensor, as in a
    `keras.Sequential`. Apply the returned layers in order:
    `for layer in checkpoint_blocks(blocks): x = layer(x)`, or
    `keras.Sequential(checkpoint_blocks(blocks))`.

    Args:
        blocks: Sequence of `keras.layers.Layer`. The blocks, in the order
            they are applied.
        segments: int. The number of segments, between 1 and
            `len(blocks)`; segment lengths differ by at most one, longer
            segments first. Defaults to `round(sqrt(len(blocks)))`.
        checkpoint_last: bool. Whether to recompute the last segment too.
            Defaults to `False`.

    Returns:
        A list of `segments` `Checkpointed` layers to apply in order, each
        wrapping a segment (a `keras.Sequential` when it has several
        blocks); the last has `recompute=False` unless `checkpoint_last`.

    Raises:
        ValueError: If `blocks` is empty or holds something other than
            layers, if `segments` is out of range, or if `checkpoint_last`
            is not a bool.

    Example:
    >>> blocks = [keras.layers.Dense(64, activation="relu") for _ in range(9)]
    >>> layers = checkpoint_blocks(blocks)  # 3 segments of 3 blocks
    >>> [layer.recompute for layer in layers]
    [True, True, False]
    >>> model = keras.Sequential([keras.Input((64,)), *layers])
    """
    given = blocks
    blocks = list(blocks) if isinstance(blocks, Iterable) else []
    if not blocks or not all(isinstance(b, keras.layers.Layer) for b in blocks):
        raise ValueError(
            "`blocks` must be a non-empty sequence of `keras.layers.Layer`. "
            f"Received: blocks={given!r}"
        )
    if segments is None:
        segments = max(1, round(math.sqrt(len(blocks))))
    if (
        isinstance(segments, bool)
        or not isinstance(segments, int)
        or not 1 <= segments <= len(blocks)
    ):
        raise ValueError(
            "`segments` must be an integer between 1 and len(blocks)="
            f"{len(blocks)}. Received: segments={segments!r}"
        )
    if not isinstance(checkpoint_last, bool):
        raise ValueError(
            "`checkpoint_last` must be True or False. "
            f"Received: checkpoint_last={checkpoint_last!r}"
        )
    groups = []
    start = 0
    for index in range(segments):
        size = len(blocks) // segments + (index < len(blocks) % segments)
        groups.append(blocks[start : start + size])
        start += size
    return [
        Checkpointed(
            group[0] if len(group) == 1 else keras.Sequential(group),
            recompute=checkpoint_last or index < segments - 1,
        )
        for index, group in enumerate(groups)
    ]
