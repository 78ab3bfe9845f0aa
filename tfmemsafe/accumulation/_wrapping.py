"""`with_gradient_accumulation`: an existing model as an `AccumulatingModel`.

A functional model becomes a functional `AccumulatingModel` over the same
layers; any other model is wrapped in one (`_WrappedModel`) that calls it
and shares its weights.
"""

from __future__ import annotations

import keras

from tfmemsafe import _checks
from tfmemsafe import _compat
from tfmemsafe.accumulation._model import AccumulatingModel


@keras.saving.register_keras_serializable(package="tfmemsafe")
class _WrappedModel(AccumulatingModel):
    """An `AccumulatingModel` that calls another model (sharing weights)."""

    def __init__(self, inner_model, accumulation_steps=1, **kwargs):
        # `samples_per_update` or `tokens_per_update` pass on in `kwargs`.
        super().__init__(accumulation_steps=accumulation_steps, **kwargs)
        self.inner_model = inner_model
        if inner_model.built:
            self.built = True

    def call(self, inputs, training=None):
        return self.inner_model(inputs, training=training)

    def get_config(self):
        return {
            "name": self.name,
            "inner_model": keras.saving.serialize_keras_object(
                self.inner_model
            ),
            "accumulation_steps": self.accumulation_steps,
            **{
                name: getattr(self, name)
                for name in ("samples_per_update", "tokens_per_update")
                if getattr(self, name) is not None
            },
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config["inner_model"] = keras.saving.deserialize_keras_object(
            config["inner_model"], custom_objects=custom_objects
        )
        return cls(**config)


def with_gradient_accumulation(
    model: keras.Model,
    accumulation_steps: int | None = None,
    *,
    samples_per_update: int | None = None,
    tokens_per_update: int | None = None,
) -> AccumulatingModel:
    """Returns `model` as an `AccumulatingModel` that shares its weights.

    A functional model becomes a functional `AccumulatingModel` over the
    same layers; a `Sequential` or subclassed model (built or not) is
    wrapped. Training either trains `model`'s own variables. If `model` is
    compiled, the result is compiled the same way with the same optimizer
    instance, so its state (and `iterations`) carries on.

    Args:
        model: A `keras.Model`. An `AccumulatingModel` is returned as is.
        accumulation_steps: int. Micro-batches per optimizer update.
            Defaults to the value an `AccumulatingModel` has, else to 1:
            it trains as before until the value is raised (as
            `tfmemsafe.fit` does when it halves the batch).
        samples_per_update: int or `None`. Close each window at this many
            samples or more instead (see `AccumulatingModel`). Defaults to
            `None`.
        tokens_per_update: int or `None`. Close each window at this many
            padded tokens or more instead. Defaults to `None`.

    Returns:
        An `AccumulatingModel`.

    Raises:
        ValueError: The model's class has its own `train_step`,
            `test_step` or `compute_loss`, which the result would not run.

    Example:

    ```python
    model = keras.applications.MobileNetV2(weights=None)
    model.compile("adam", "sparse_categorical_crossentropy")
    model = tfmemsafe.with_gradient_accumulation(model, 8)
    model.fit(x, y, batch_size=16)  # updates of 128 samples
    ```
    """
    _checks.model(model)
    by_size = {
        name: value
        for name, value in (
            ("samples_per_update", samples_per_update),
            ("tokens_per_update", tokens_per_update),
        )
        if value is not None
    }
    if isinstance(model, AccumulatingModel):
        if by_size:
            given = ", ".join(f"{k}={v}" for k, v in by_size.items())
            raise ValueError(
                "An `AccumulatingModel`'s update size is set when it is "
                "constructed; pass a model that is not one yet. Received: "
                f"{given} for {model.name}, an `AccumulatingModel`"
            )
        if accumulation_steps is not None:
            model.accumulation_steps = accumulation_steps
        return model
    own = [
        name
        for name in ("train_step", "test_step", "compute_loss")
        if getattr(type(model), name) is not getattr(keras.Model, name)
    ]
    if own:
        raise ValueError(
            "`with_gradient_accumulation` trains with `AccumulatingModel`'s "
            f"own steps, so the model's own `{own[0]}` would not run. "
            "Instead, accumulate in that step with "
            "`tfmemsafe.GradientAccumulator` (docs/gradient-accumulation.md), "
            f"or make the model's class derive from `AccumulatingModel`. "
            f"Received: a {type(model).__name__} overriding "
            f"{', '.join(own)}"
        )
    if accumulation_steps is None:
        accumulation_steps = 1
    accumulation_steps = _checks.integer(
        "accumulation_steps", accumulation_steps
    )
    functional = _compat.functional_class()
    if functional is not None and isinstance(model, functional):
        result = AccumulatingModel(
            model.input,
            model.output,
            name=model.name,
            accumulation_steps=accumulation_steps,
            **by_size,
        )
    else:
        result = _WrappedModel(
            model,
            accumulation_steps=accumulation_steps,
            name=model.name,
            **by_size,
        )
    compile_config = getattr(model, "_compile_config", None)
    if model.compiled and compile_config is not None:
        arguments = dict(compile_config.config)
        # The optimizer itself, already wrapped for loss scaling if needed.
        arguments.update(optimizer=model.optimizer, auto_scale_loss=False)
        result.compile(**arguments)
    return result
