"""Variable-length sequences under a memory cap: three ways to batch them.

Trains `tfmemsafe.testing.reference_model`'s GRU or transformer
classifier on `--sequences` synthetic token sequences of log-normal
length (median `--median`, one at `--longest`, none longer), under a
real allocator cap (`tfmemsafe.testing.run_with_memory_cap`), for
`--epochs`, batched three ways:

- fixed: `padded_batch` at the largest batch that trains at the longest
  length, so that no batch can run out;
- by hand: `tf.data.Dataset.bucket_by_sequence_length` with the buckets
  `memory_buckets` chooses and, for each, the largest batch that trains
  at its length, found by trial (`tfmemsafe.find_max_batch_size` on
  sequences of that length, 10% headroom): what a careful user would do,
  in minutes of trials (their time is printed, not counted);
- memory: `tfmemsafe.data.bucket_by_memory(examples, model)`, its
  planning (the length pass and its probes) counted.

Neither bucketed way gives a bucket more than `--max_batch_size`
(8,192). The table also sets each way's epochs alone (its planning left
out) beside the hand-found buckets', since the planning is paid once,
however many epochs follow.

With `--held`, then, for `--rounds` rounds, two more runs side by side:
`tfmemsafe.fit(examples, batch_size="auto")` for five epochs, once with
the allocator filled by something else (`tfmemsafe.testing.HeldMemory`)
at epoch 3, step `--hold_step`, all but `--leave_mb` of it (100 MB),
and let go at the next step, and once
with nothing held. The batch that runs out is trained again in its
step as micro-batches, the next batch comes at its bucket's planned
size, and the split size grows back after `grow_back_after` clean
steps. Its table gives each epoch's tokens per second in both
runs and their ratio: an epoch's throughput on this machine moves by
more than the hold's effect from one epoch to the next, so epochs 4 and
5 (after the hold) are set beside the same epochs with nothing held,
not beside epoch 2. `--nobatching` skips the three ways.

Each way trains in a fresh process under the cap, the three in turn for
`--rounds` rounds. The table gives the tokens (not padding) trained per
second of wall and of CPU time, against the fixed batch's, and the
allocator's out-of-memory reports (`tfmemsafe.testing.AllocatorFailures`).

Example:
    python benchmarks/variable_length.py --model=gru --rounds=1
"""

import statistics
import time

from absl import app
from absl import flags

_MODEL = flags.DEFINE_enum(
    "model", "gru", ["gru", "transformer"], "The reference network."
)
_SEQUENCES = flags.DEFINE_integer("sequences", 20_000, "Training sequences.")
_MEDIAN = flags.DEFINE_integer("median", 64, "Median length, in tokens.")
_LONGEST = flags.DEFINE_integer("longest", 1024, "The longest sequence.")
_EPOCHS = flags.DEFINE_integer("epochs", 1, "Epochs per way.")
_CAP_MB = flags.DEFINE_integer("cap_mb", 400, "The allocator's limit in MB.")
_ROUNDS = flags.DEFINE_integer(
    "rounds", 1, "Rounds of the three ways, and of the --held pair."
)
_HELD = flags.DEFINE_bool(
    "held", False, "Also train with memory held for a while mid-training."
)
_BATCHING = flags.DEFINE_bool(
    "batching", True, "Measure the three ways (off: only the --held runs)."
)
_HOLD_STEP = flags.DEFINE_integer(
    "hold_step", 5, "The step of epoch 3 at which memory is held."
)
_LEAVE_MB = flags.DEFINE_integer(
    "leave_mb", 100, "Megabytes of the cap the held memory leaves free."
)
_MAX_BATCH_SIZE = flags.DEFINE_integer(
    "max_batch_size",
    8192,
    "The largest batch either bucketed way may give a bucket.",
)

WAYS = ("fixed", "by hand", "memory")


def sequences(count, median, longest, seed=0):
    """Unbatched `(token ids, label)`; and the lengths."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(np.log(median), 0.8, count).astype(int)
    lengths = np.clip(lengths, 1, longest)
    lengths[count // 2] = longest
    tokens = [rng.integers(1, 2000, n) for n in lengths]
    labels = np.array([t[0] % 4 for t in tokens], "int32")
    ragged = tf.ragged.constant(tokens, dtype=tf.int32)
    dataset = tf.data.Dataset.from_tensor_slices((ragged, labels))
    # A `map` hands the rows on as dense tensors (`padded_batch` refuses
    # ragged ones).
    return dataset.map(lambda x, y: (x, y)), lengths


def _at_length(data, length):
    """`batch_size -> dataset` of the sequences made `length` long."""
    import tensorflow as tf

    def resize(x, y):
        times = -(-length // tf.shape(x)[0])
        return tf.ensure_shape(tf.tile(x, [times])[:length], [length]), y

    fixed = data.map(resize).repeat()
    return lambda batch_size: fixed.batch(batch_size, drop_remainder=True)


def search_sizes(name, count, median, longest, max_batch_size):
    """In a capped process: the buckets, and each one's size by trial."""
    import tfmemsafe
    from tfmemsafe import testing

    data, _ = sequences(count, median, longest)
    start = time.perf_counter()
    model = testing.reference_model(name, (None,))
    buckets = tfmemsafe.data.memory_buckets(
        data, model, max_batch_size=max_batch_size
    )

    def by_trial(length):
        return tfmemsafe.find_max_batch_size(
            model, _at_length(data, length), max_batch_size=max_batch_size
        )

    sizes = [by_trial(length) for length in buckets.lengths]
    return {
        "boundaries": list(buckets.bucket_boundaries),
        "lengths": list(buckets.lengths),
        "sizes": sizes,
        "fixed": sizes[-1],
        "memory": list(buckets.bucket_batch_sizes[:-1]),
        "seconds": time.perf_counter() - start,
        "max_batch_size": max_batch_size,
    }


def run_way(way, name, count, median, longest, epochs, found):
    """Trains one way in this capped process; returns its timings."""
    import tensorflow as tf

    import tfmemsafe
    from tfmemsafe import testing

    data, lengths = sequences(count, median, longest)
    data = data.shuffle(count, seed=1)
    model = testing.reference_model(name, (None,))
    wall, cpu = time.perf_counter(), time.process_time()
    plan = 0.0
    if way == "fixed":
        batched = data.padded_batch(found["fixed"])
    elif way == "by hand":
        batched = data.bucket_by_sequence_length(
            lambda x, y: tf.shape(x)[0],
            found["boundaries"],
            found["sizes"] + [1],
            pad_to_bucket_boundary=True,
        )
    else:
        batched = tfmemsafe.data.bucket_by_memory(
            data, model, max_batch_size=found["max_batch_size"]
        )
        plan = time.perf_counter() - wall
    died = None
    with testing.AllocatorFailures() as failures:
        try:
            model.fit(batched.prefetch(1), epochs=epochs, verbose=0)
        except tf.errors.ResourceExhaustedError as err:
            died = str(err).splitlines()[0][:120]
    return {
        "wall": time.perf_counter() - wall,
        "cpu": time.process_time() - cpu,
        "plan": plan,
        "tokens": int(lengths.sum()) * epochs,
        "failures": failures.count,
        "died": died,
    }


def run_held(name, count, median, longest, hold_step, leave_mb):
    """`tfmemsafe.fit(batch_size="auto")` for five epochs with memory held
    at epoch 3, step `hold_step` until the next step (`None`: nothing
    held), in this capped process; returns each epoch's timings and what
    recovery did."""
    import keras

    import tfmemsafe
    from tfmemsafe import testing

    data, lengths = sequences(count, median, longest)
    data = data.shuffle(count, seed=1)
    model = testing.reference_model(name, (None,))
    begun, took = {}, {}

    def begin(epoch, logs=None):
        begun[epoch] = (time.perf_counter(), time.process_time())

    def end(epoch, logs=None):
        wall, cpu = begun[epoch]
        took[epoch] = (time.perf_counter() - wall, time.process_time() - cpu)

    timer = keras.callbacks.LambdaCallback(
        on_epoch_begin=begin, on_epoch_end=end
    )
    with testing.AllocatorFailures() as failures:
        history = tfmemsafe.fit(
            model,
            data,
            batch_size="auto",
            epochs=5,
            grow_back_after=5,
            callbacks=[timer]
            if hold_step is None
            else [testing.HeldMemory(2, hold_step, leave_mb=leave_mb), timer],
            verbose=0,
        )
    return {
        "epochs": [took[epoch] for epoch in sorted(took)],
        "tokens": int(lengths.sum()),
        "events": [str(e) for e in history.oom_events],
        "grown": [str(e) for e in history.grow_back_events],
        "failures": failures.count,
    }


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    shape = [_SEQUENCES.value, _MEDIAN.value, _LONGEST.value]
    if not (_BATCHING.value or _HELD.value):
        raise app.UsageError("Nothing to measure: --nobatching, no --held.")
    if _BATCHING.value:
        _batchings(shape)
    if _HELD.value:
        _helds(shape)


def _batchings(shape):
    """The three ways, `--rounds` rounds, and their table."""
    from tfmemsafe import testing

    found = testing.run_with_memory_cap(
        search_sizes,
        _CAP_MB.value,
        args=[_MODEL.value, *shape, _MAX_BATCH_SIZE.value],
        timeout=3600,
    )
    print(
        f"By trial ({found['seconds']:.0f} s): lengths {found['lengths']}, "
        f"sizes {found['sizes']}; memory_buckets chose {found['memory']}.",
        flush=True,
    )
    runs = {way: [] for way in WAYS}
    for round_index in range(_ROUNDS.value):
        turn = round_index % len(WAYS)
        for way in WAYS[turn:] + WAYS[:turn]:
            result = testing.run_with_memory_cap(
                run_way,
                _CAP_MB.value,
                args=[way, _MODEL.value, *shape, _EPOCHS.value, found],
                timeout=7200,
            )
            print(f"{way}: {result}", flush=True)
            runs[way].append(result)

    print()
    print(
        f"{_MODEL.value}, {_SEQUENCES.value} sequences (median "
        f"{_MEDIAN.value}, longest {_LONGEST.value} tokens), "
        f"{_EPOCHS.value} epoch(s) under a {_CAP_MB.value} MB cap, "
        f"{_ROUNDS.value} round(s) (medians; ratios per round)."
    )
    print(
        "| batching | tokens/s (wall) | vs fixed | tokens/s (CPU) | vs fixed "
        "| planning s | epochs alone: speed vs by hand (wall) "
        "| allocator OOMs "
        "| ran out |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    fixed = runs["fixed"]
    by_hand = runs["by hand"]
    for way in WAYS:
        rows = runs[way]
        wall = [r["tokens"] / r["wall"] for r in rows]
        cpu = [r["tokens"] / r["cpu"] for r in rows]
        wall_ratio = [
            (r["tokens"] / r["wall"]) / (f["tokens"] / f["wall"])
            for r, f in zip(rows, fixed, strict=True)
        ]
        cpu_ratio = [
            (r["tokens"] / r["cpu"]) / (f["tokens"] / f["cpu"])
            for r, f in zip(rows, fixed, strict=True)
        ]
        epochs_ratio = [
            (r["wall"] - r["plan"]) and h["wall"] / (r["wall"] - r["plan"])
            for r, h in zip(rows, by_hand, strict=True)
        ]
        print(
            f"| {way} | {statistics.median(wall):,.0f} | "
            f"{_spread(wall_ratio)} | {statistics.median(cpu):,.0f} | "
            f"{_spread(cpu_ratio)} | "
            f"{statistics.median(r['plan'] for r in rows):.1f} | "
            f"{_spread(epochs_ratio)} | "
            f"{sum(r['failures'] for r in rows)} | "
            f"{sum(bool(r['died']) for r in rows)} of {len(rows)} |"
        )


def _helds(shape):
    """Held and nothing held, `--rounds` rounds in turn, and the table."""
    from tfmemsafe import testing

    runs = {"held": [], "free": []}
    for round_index in range(_ROUNDS.value):
        order = ("held", "free") if round_index % 2 == 0 else ("free", "held")
        for kind in order:
            step = _HOLD_STEP.value if kind == "held" else None
            result = testing.run_with_memory_cap(
                run_held,
                _CAP_MB.value,
                args=[_MODEL.value, *shape, step, _LEAVE_MB.value],
                timeout=7200,
            )
            print(f"{kind}: {result}", flush=True)
            runs[kind].append(result)
    _print_held(runs)


def _print_held(runs):
    held, free = runs["held"], runs["free"]
    print()
    print(
        f"Memory held at epoch 3, step {_HOLD_STEP.value} (all but "
        f"{_LEAVE_MB.value} MB), until the next "
        f"step, against nothing held; {len(held)} round(s) (medians; "
        "ratios per round)."
    )
    for result in held:
        print(
            f"Held: {'; '.join(result['events'])}; "
            f"{'; '.join(result['grown']) or 'never grew back'}; "
            f"{result['failures']} allocator OOMs."
        )
    print(
        "| epoch | held tokens/s (wall) | nothing held | held / nothing "
        "held (wall) | (CPU) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for index in range(len(held[0]["epochs"])):

        def rate(result, which, index=index):
            return result["tokens"] / result["epochs"][index][which]

        ratios = [
            [
                rate(h, which) / rate(f, which)
                for h, f in zip(held, free, strict=True)
            ]
            for which in (0, 1)
        ]
        note = {2: " (held)", 3: " (after)", 4: " (after)"}.get(index, "")
        print(
            f"| {index + 1}{note} | "
            f"{statistics.median(rate(h, 0) for h in held):,.0f} | "
            f"{statistics.median(rate(f, 0) for f in free):,.0f} | "
            f"{_spread(ratios[0])} | {_spread(ratios[1])} |"
        )


def _spread(ratios):
    low, high = min(ratios), max(ratios)
    if abs(high - low) < 0.005:
        return f"{low:.2f}x"
    return f"{low:.2f}-{high:.2f}x"


if __name__ == "__main__":
    app.run(main)
