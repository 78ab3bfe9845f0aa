"""The planner against every candidate run by hand, under a real memory cap.

Trains a residual network of nested dense blocks (default: 12 blocks of
width 128, batch 4096) under a capped CPU allocator, in fresh processes:

- `plan`: `tfmemsafe.plan(model, x, y, batch_size)`, timed, and the
  candidate it chose.
- by hand: each candidate trained with plain `model.fit` for `--steps`
  steps after one that traces: the whole batch or k micro-batches
  (`tfmemsafe.SplitBatchOnOOM(micro_batch_size=batch // k)`), with the
  blocks as they are or wrapped in `tfmemsafe.Checkpointed` (the last
  one kept), each in a process of its own; `--rounds` rounds of every
  candidate in turn, so that load and the machine's state fall alike on
  all, each candidate's median rate kept (and "ran out" if it ran out in
  any round).

It prints one table: each candidate's samples a second by hand, whether
it ran out of memory (an out-of-memory error the callback split), and
the plan's choice as a ratio of the best by hand; and the planning time
against ten epochs of `--epoch_batches` batches at the chosen speed.

Example:
    python benchmarks/planner.py --cap_mb=200 --batch_size=4096
"""

import statistics
import time

from absl import app
from absl import flags

_WIDTH = flags.DEFINE_integer("width", 128, "Width of every block.")
_BLOCKS = flags.DEFINE_integer("blocks", 12, "Residual blocks.")
_BATCH_NORM = flags.DEFINE_boolean(
    "batch_norm",
    False,
    "A BatchNormalization in every block: micro-batches would be "
    "normalized otherwise than the whole batch, so only recomputation "
    "can make the batch fit.",
)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 4096, "The batch to train.")
_CAP_MB = flags.DEFINE_integer("cap_mb", 200, "The CPU allocator's cap.")
_STEPS = flags.DEFINE_integer("steps", 5, "Measured steps per candidate.")
_MICRO_BATCHES = flags.DEFINE_list(
    "micro_batches", ["1", "2", "4", "8"], "Micro-batch counts by hand."
)
_ROUNDS = flags.DEFINE_integer(
    "rounds",
    2,
    "Rounds of every candidate by hand, in turn; the median.",
    lower_bound=1,
)
_EPOCH_BATCHES = flags.DEFINE_integer(
    "epoch_batches", 50, "Batches in an epoch, for the planning's share."
)


def _model(width, blocks, checkpointed, batch_norm):
    import keras

    import tfmemsafe

    keras.utils.set_random_seed(0)

    def block():
        inputs = keras.Input((width,))
        hidden = keras.layers.Dense(4 * width, activation="relu")(inputs)
        if batch_norm:
            hidden = keras.layers.BatchNormalization()(hidden)
        hidden = keras.layers.Dense(4 * width, activation="relu")(hidden)
        hidden = keras.layers.Dense(width)(hidden)
        return keras.Model(inputs, keras.layers.Add()([inputs, hidden]))

    inputs = keras.Input((64,))
    x = keras.layers.Dense(width)(inputs)
    for index in range(blocks):
        layer = block()
        if checkpointed:
            layer = tfmemsafe.Checkpointed(layer, recompute=index < blocks - 1)
        x = layer(x)
    model = keras.Model(inputs, keras.layers.Dense(10)(x))
    model.compile(
        "adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def _data(rows):
    import numpy as np

    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(rows, 64)).astype("float32"),
        rng.integers(0, 10, rows),
    )


def planned(width, blocks, batch_norm, batch_size):
    """The plan, and how long it took."""
    import tfmemsafe

    model = _model(width, blocks, checkpointed=False, batch_norm=batch_norm)
    x, y = _data(2 * batch_size)
    started = time.perf_counter()
    plan = tfmemsafe.plan(model, x, y, batch_size=batch_size, verbose=0)
    return {
        "seconds": time.perf_counter() - started,
        "table": str(plan),
        "chosen": plan.chosen.name,
    }


def by_hand(
    width, blocks, batch_norm, batch_size, micro_batches, checkpointed, steps
):
    """Samples a second of one candidate in plain `model.fit`."""
    import keras

    import tfmemsafe

    model = _model(width, blocks, checkpointed, batch_norm)
    x, y = _data((steps + 1) * batch_size)
    times = []

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.began = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.began)

    split = tfmemsafe.SplitBatchOnOOM(
        grow_back_after=None,
        micro_batch_size=(
            None if micro_batches == 1 else -(-batch_size // micro_batches)
        ),
    )
    try:
        model.fit(
            x,
            y,
            batch_size=batch_size,
            shuffle=False,
            verbose=0,
            callbacks=[Timer(), split],
        )
    except tfmemsafe.OutOfMemoryError:
        # Not split: a model whose micro-batches would not be exact.
        return {"samples_per_second": 0.0, "ran_out": True}
    return {
        "samples_per_second": batch_size / statistics.median(times[1:]),
        "ran_out": bool(split.oom_events),
    }


def main(argv):
    del argv  # Unused.
    from tfmemsafe import testing

    shape = (_WIDTH.value, _BLOCKS.value, _BATCH_NORM.value, _BATCH_SIZE.value)
    # Micro-batches of a model with batch normalization are refused.
    counts = (
        [1] if _BATCH_NORM.value else [int(c) for c in _MICRO_BATCHES.value]
    )
    plan = testing.run_with_memory_cap(planned, _CAP_MB.value, args=shape)
    runs = {}  # Each candidate's results, in the order first run.
    for _ in range(_ROUNDS.value):
        for checkpointed in (False, True):
            for count in counts:
                name = f"{count} x {-(-_BATCH_SIZE.value // count)}"
                name += ", checkpointed" if checkpointed else ""
                runs.setdefault(name, []).append(
                    testing.run_with_memory_cap(
                        by_hand,
                        _CAP_MB.value,
                        args=(*shape, count, checkpointed, _STEPS.value),
                    )
                )
    rows = [
        (
            name,
            {
                # Of the rounds that trained (a refused split trains none).
                "samples_per_second": statistics.median(
                    [
                        r["samples_per_second"]
                        for r in runs[name]
                        if r["samples_per_second"]
                    ]
                    or [0.0]
                ),
                "ran_out": any(r["ran_out"] for r in runs[name]),
            },
        )
        for name in runs
    ]
    print(plan["table"])
    print()
    best = max(
        (r["samples_per_second"] for _, r in rows if not r["ran_out"]),
        default=None,
    )
    print(f"{'candidate (by hand)':26}  {'samples/s':>10}  ran out")
    for name, result in rows:
        mark = "*" if name == plan["chosen"] else " "
        rate = result["samples_per_second"]
        rate = f"{rate:10.1f}" if rate else f"{'-':>10}"
        print(
            f"{mark} {name:24}  {rate}  {'yes' if result['ran_out'] else 'no'}"
        )
    chosen = dict(rows).get(plan["chosen"])
    if chosen is not None and chosen["samples_per_second"] and best:
        print(
            f"\nchosen {plan['chosen']}: "
            f"{chosen['samples_per_second'] / best:.2f}x the best by hand "
            f"(that ran without running out)"
        )
        epochs = (
            10
            * _EPOCH_BATCHES.value
            * _BATCH_SIZE.value
            / chosen["samples_per_second"]
        )
        print(
            f"planning {plan['seconds']:.1f} s; 10 epochs of "
            f"{_EPOCH_BATCHES.value} batches at the chosen speed "
            f"{epochs:.0f} s: {100 * plan['seconds'] / epochs:.1f}%"
        )


if __name__ == "__main__":
    app.run(main)
