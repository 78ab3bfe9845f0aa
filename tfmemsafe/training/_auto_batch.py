"""`tfmemsafe.fit(batch_size="auto")`: the largest batch size found to
fit, or, for examples of varying length, memory-sized length buckets."""

from __future__ import annotations

from absl import logging

from tfmemsafe import data as data_lib
from tfmemsafe import planning
from tfmemsafe._keras_data import is_iterable_only
from tfmemsafe._keras_data import padded_batches
from tfmemsafe._keras_data import samples_of
from tfmemsafe._keras_data import varies_in_length
from tfmemsafe.accumulation import accumulation_steps_of


def auto_batch(
    model, x, y, validation_data, validation_split, memory_estimate, verbose
):
    """`batch_size="auto"`: `(x, validation_data, batch_size)`, with
    examples of varying length batched by memory buckets (the batch size
    the first bucket's), else the largest batch size found to fit, at
    most the samples trained on (without `validation_split`'s)."""
    if is_iterable_only(x):
        raise ValueError(
            "`batch_size='auto'` needs data it can batch (arrays, a "
            "tf.data.Dataset or a callable). Received: x of type "
            f"{type(x).__name__}"
        )
    if varies_in_length(x):
        return _bucketed(model, x, validation_data, verbose)
    if padded_batches(x):
        raise ValueError(
            "`batch_size='auto'` chooses the batch size, and `x` is batched "
            "already, its examples padded to each batch's longest, which "
            "cannot be batched again. Pass the unbatched examples: they are "
            f"then batched by length buckets. Received: x={x!r:.80}"
        )
    largest = {}
    samples = samples_of(x, validation_split) if validation_split else None
    if samples:  # Without the rows `model.fit` keeps for validation.
        largest["max_batch_size"] = samples
    batch_size = planning.find_max_batch_size(
        model,
        x if y is None else (x, y),
        memory_estimate=memory_estimate,
        verbose=verbose,
        **largest,
    )
    logging.info("tfmemsafe.fit: batch_size='auto' chose %d.", batch_size)
    return x, validation_data, batch_size


def _bucketed(model, x, validation_data, verbose):
    """The training (and validation) examples in memory buckets, planned
    on both, so that no validation example is longer than the buckets;
    and the first bucket's batch size."""
    planned_on = x
    if varies_in_length(validation_data):
        planned_on = x.concatenate(validation_data)
    # Windows that close at a number of samples (tokens) take no batch
    # past it, so that an update stays under twice it.
    buckets = data_lib.memory_buckets(
        planned_on, model, verbose=verbose, **_capped_by_update_size(model)
    )
    logging.info("tfmemsafe.fit: batch_size='auto' chose:\n%s", buckets)
    steps = accumulation_steps_of(model)
    sizes = buckets.bucket_batch_sizes[:-1]
    if steps and steps > 1 and min(sizes) != max(sizes):
        logging.warning(
            "tfmemsafe.fit: accumulation_steps=%d counts batches, and the "
            "buckets' batches hold %d to %d samples: updates of %d to %d "
            "samples. For updates of one size, build the model with "
            "`samples_per_update` (or `tokens_per_update`) instead.",
            steps,
            min(sizes),
            max(sizes),
            steps * min(sizes),
            steps * max(sizes),
        )
    if varies_in_length(validation_data):
        validation_data = buckets.apply(validation_data)
    return buckets.apply(x), validation_data, buckets.bucket_batch_sizes[0]


def _capped_by_update_size(model) -> dict:
    """`memory_buckets`' caps for a model whose windows close by size."""
    samples = getattr(model, "samples_per_update", None)
    tokens = getattr(model, "tokens_per_update", None)
    if samples:
        return {"max_batch_size": samples}
    if tokens:
        return {"max_tokens": tokens}
    return {}
