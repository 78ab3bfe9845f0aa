"""Flags and steps shared by the example scripts.

Each script defines its model and its own flags and calls these for the
rest: the shared flags, the `--memory_cap_mb` re-run, the runtime set-up,
the data, the callbacks and the closing summary.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time

# First, before TensorFlow: it keeps TensorFlow's allocator dump out of the
# output (docs/runtime.md).
import tfmemsafe  # isort: skip

import keras
import tensorflow as tf
from absl import app
from absl import flags
from absl import logging

from tfmemsafe import runtime

DATASET = flags.DEFINE_enum(
    "dataset",
    "cifar10",
    ["cifar10", "digits"],
    "cifar10 (through tensorflow_datasets, downloaded the first time) or "
    "digits (scikit-learn's 1,797 handwritten digits at 32x32x3; needs no "
    "network).",
)
DATA_DIR = flags.DEFINE_string(
    "data_dir",
    None,
    "Where tensorflow_datasets keeps prepared datasets. Defaults to "
    "~/tensorflow_datasets.",
)
BATCH_SIZE = flags.DEFINE_string(
    "batch_size",
    "128",
    "The global batch size, or 'auto' for the largest that trains with 10% "
    "of the memory to spare (tfmemsafe.find_max_batch_size).",
)
EPOCHS = flags.DEFINE_integer("epochs", 10, "Epochs to train.", lower_bound=1)
STEPS_PER_EPOCH = flags.DEFINE_integer(
    "steps_per_epoch",
    None,
    "Training batches per epoch. Defaults to the whole training split.",
    lower_bound=1,
)
ACCUMULATION_STEPS = flags.DEFINE_integer(
    "accumulation_steps",
    1,
    "Batches per weight update (gradient accumulation): each update "
    "averages batch_size times this many samples.",
    lower_bound=1,
)
PRECISION = flags.DEFINE_enum(
    "precision",
    "auto",
    list(runtime.PRECISIONS),
    "The Keras dtype policy. auto picks mixed_float16 on GPUs with Tensor "
    "Cores and float32 elsewhere.",
)
MEMORY_GROWTH = flags.DEFINE_boolean(
    "memory_growth",
    True,
    "Let TensorFlow take GPU memory as it needs it, instead of all of it "
    "at start-up.",
)
MODEL_DIR = flags.DEFINE_string(
    "model_dir",
    None,
    "Where to write the .keras model, history.csv, summary.json and the "
    "memory plot. Defaults to model_dir/<script name>.",
)
MEMORY_CAP_MB = flags.DEFINE_integer(
    "memory_cap_mb",
    None,
    "Run the training in a new process whose CPU allocator holds at most "
    "this many megabytes (GPUs hidden), to watch an out-of-memory error "
    "happen and be recovered from without a GPU.",
    lower_bound=1,
)
PREFLIGHT = flags.DEFINE_boolean(
    "preflight",
    True,
    "Let tfmemsafe.fit estimate the training step's memory before the "
    "first step and start at a batch size predicted to fit. With "
    "--nopreflight and --memory_cap_mb, watch a real out-of-memory error "
    "and its recovery instead.",
)
SEED = flags.DEFINE_integer(
    "seed",
    None,
    "Seed for Python, NumPy, TensorFlow and Keras, for repeatable runs. "
    "Defaults to a different run each time.",
    lower_bound=0,
    upper_bound=2**32 - 1,  # NumPy's seeds.
)

# Set in the process started for --memory_cap_mb, so it does not start
# another.
_CAPPED_RUN = "TFMEMSAFE_EXAMPLE_CAPPED_RUN"
_CAPPED_RUN_TIMEOUT = 7 * 24 * 3600


@dataclasses.dataclass
class Run:
    """One `tfmemsafe.fit` (or `fit_head`) call, for the summary.

    Create it right after the call: it reads the model's
    `accumulation_steps` then, before a later run can change them.

    Attributes:
        name: What the run trained, e.g. `"training"` or `"fine-tuning"`.
        history: The `keras.callbacks.History` it returned.
        monitor: The `tfmemsafe.MemoryMonitor` it was given.
        accumulation_steps: The model's `accumulation_steps` at the end of
            the run, or `None` for a model without.
    """

    name: str
    history: keras.callbacks.History
    monitor: tfmemsafe.MemoryMonitor
    accumulation_steps: int | None = dataclasses.field(init=False)

    def __post_init__(self):
        self.accumulation_steps = getattr(
            self.history.model, "accumulation_steps", None
        )


def batch_size() -> int | str:
    """The --batch_size flag as an int, or `"auto"`.

    Raises:
        app.UsageError: If it is neither a positive integer nor "auto".
    """
    value = BATCH_SIZE.value.strip().lower()
    if value == "auto":
        return "auto"
    if not value.isdigit() or int(value) < 1:
        raise app.UsageError(
            "--batch_size must be a positive integer or 'auto'. "
            f"Received: --batch_size={BATCH_SIZE.value}"
        )
    return int(value)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What `set_up` decided, for the rest of `main`.

    Attributes:
        batch_size: The --batch_size flag, an int or `"auto"`.
        directory: The output directory, created. On worker `i > 0` of a
            multi-worker job, its `worker_<i>` subdirectory.
        started: `time.time()` when `set_up` was called.
        backup_dir: In a multi-worker job, where the chief backs up each
            epoch for a restart to resume from; else `None`.
    """

    batch_size: int | str
    directory: str
    started: float
    backup_dir: str | None = None


def set_up(script_path: str, argv: list[str]) -> Setup | None:
    """The steps every script's `main` starts with.

    Checks the shared flags, re-runs the script under --memory_cap_mb (see
    `_rerun_under_memory_cap`), applies --precision, --memory_growth and
    --seed, and creates the output directory. Check the script's own
    flags before calling it, so that a usage error stops the script
    before any process is started.

    Args:
        script_path: The script's file, `__file__`.
        argv: What `app.run` passes to `main`.

    Returns:
        A `Setup`, or `None` if the training already ran in a capped
        process and `main` should return.

    Raises:
        app.UsageError: If the command line holds words that are not
            flags, or --batch_size is not valid.
    """
    started = time.time()
    if len(argv) > 1:
        raise app.UsageError(
            f"Expected only flags. Received the arguments: {' '.join(argv[1:])}"
        )
    size = batch_size()
    if _rerun_under_memory_cap(script_path):
        return None
    _configure_runtime()
    strategy = distribution_strategy()
    script = os.path.splitext(os.path.basename(script_path))[0]
    directory = MODEL_DIR.value or os.path.join("model_dir", script)
    backup_dir = None
    if tfmemsafe.distribute.is_multi_worker(strategy):
        # Worker 0 writes the job's outputs; the others keep their own
        # (their memory plots and summaries) apart. All restore from the
        # chief's backup after a restart.
        backup_dir = os.path.join(directory, "backup")
        index = tfmemsafe.distribute.worker_index(strategy)
        if index:
            directory = os.path.join(directory, f"worker_{index}")
        print(
            f"Worker {index} of {strategy.extended._num_workers}, "
            f"{strategy.num_replicas_in_sync} replicas in all; outputs in "
            f"{directory}.",
            flush=True,
        )
    os.makedirs(directory, exist_ok=True)
    return Setup(
        batch_size=size,
        directory=directory,
        started=started,
        backup_dir=backup_dir,
    )


def _rerun_under_memory_cap(script_path: str) -> bool:
    """With --memory_cap_mb, runs the script again under that cap.

    The new process is started by `tfmemsafe.testing.run_with_memory_cap`
    with the same flags: its TensorFlow CPU allocator refuses to hold more
    than the cap, so a batch that needs more raises a real
    `ResourceExhaustedError`, as a full GPU would. Its output streams
    here as it runs.

    Args:
        script_path: The script's file, `__file__`.

    Returns:
        `True` if the training ran in that process (the caller stops),
        `False` if it is to run here.
    """
    if MEMORY_CAP_MB.value is None or os.environ.get(_CAPPED_RUN):
        return False
    cap = MEMORY_CAP_MB.value
    print(
        f"Running {os.path.basename(script_path)} again in a new process "
        f"whose CPU allocator holds at most {cap} MB.",
        flush=True,
    )
    try:
        tfmemsafe.testing.run_with_memory_cap(
            script_path,
            cap,
            args=_flags_to_forward(),
            env={_CAPPED_RUN: "1"},
            timeout=_CAPPED_RUN_TIMEOUT,
            capture_output=False,
        )
    except tfmemsafe.testing.SubprocessError as err:
        sys.exit(f"error: the capped run failed: {str(err).splitlines()[0]}")
    return True


def _flags_to_forward() -> list[str]:
    """Every flag set on this command line (or by a test), serialized."""
    forwarded, seen = [], set()
    for name in flags.FLAGS:
        flag = flags.FLAGS[name]
        if id(flag) in seen or flag.using_default_value:
            continue
        seen.add(id(flag))
        forwarded.append(flag.serialize())
    return forwarded


def _configure_runtime() -> tfmemsafe.RuntimeConfig:
    """Applies --precision, --memory_growth and --seed (`configure` logs
    what it did)."""
    config = tfmemsafe.configure(
        memory_growth=MEMORY_GROWTH.value, precision=PRECISION.value
    )
    if os.environ.get(_CAPPED_RUN):
        print(
            f"CPU allocator capped at {MEMORY_CAP_MB.value} MB "
            "(TF_CPU_BFC_MEM_LIMIT_IN_MB).",
            flush=True,
        )
    if SEED.value is not None:
        keras.utils.set_random_seed(SEED.value)
    return config


def distribution_strategy() -> tf.distribute.Strategy:
    """The strategy to build and train under.

    A `tf.distribute.MultiWorkerMirroredStrategy` when `TF_CONFIG` names a
    cluster: this process is then one worker of a job that trains on
    several machines (see docs/multi-worker.md). Otherwise the default,
    one-device strategy.

    Raises:
        app.UsageError: If `TF_CONFIG` is set but is not JSON.
    """
    raw = os.environ.get("TF_CONFIG", "").strip()
    if not raw:
        return tf.distribute.get_strategy()
    try:
        cluster = json.loads(raw).get("cluster")
    except (ValueError, AttributeError) as err:
        raise app.UsageError(
            f"TF_CONFIG must be a JSON object. Received: {raw!r:.80} ({err})"
        ) from err
    if not cluster:
        return tf.distribute.get_strategy()
    return _multi_worker_strategy()


@functools.cache
def _multi_worker_strategy() -> tf.distribute.Strategy:
    # Made once per process, before other TensorFlow work, as the
    # strategy requires.
    return tf.distribute.MultiWorkerMirroredStrategy()


def load(split: str, *, augment: bool = False) -> tf.data.Dataset:
    """The --dataset split, unbatched; exits with the reason if unavailable.

    Training splits are shuffled every epoch. `augment` adds random crops
    (and, for CIFAR-10, flips).
    """
    try:
        if DATASET.value == "digits":
            return tfmemsafe.data.digits(split, augment=augment)
        return tfmemsafe.data.cifar10(
            split, data_dir=DATA_DIR.value, augment=augment
        )
    except tfmemsafe.DatasetUnavailableError as err:
        sys.exit(f"error: {err}")


def callbacks(
    directory: str, *, append: bool = False, backup_dir: str | None = None
) -> tuple[tfmemsafe.MemoryMonitor, list[keras.callbacks.Callback]]:
    """A `MemoryMonitor`, and the callbacks for `fit` that include it.

    Args:
        directory: Where `history.csv` is written.
        append: Append to `history.csv` (for a second training phase)
            instead of starting it again.
        backup_dir: With a directory, a
            `tfmemsafe.distribute.MultiWorkerBackupAndRestore` too, so that
            a restarted multi-worker job resumes (`Setup.backup_dir`).
    """
    monitor = tfmemsafe.MemoryMonitor()
    csv_logger = keras.callbacks.CSVLogger(
        os.path.join(directory, "history.csv"), append=append
    )
    extra = []
    if backup_dir:
        extra.append(
            tfmemsafe.distribute.MultiWorkerBackupAndRestore(backup_dir)
        )
    return monitor, [monitor, csv_logger, *extra]


def summarize(
    directory: str,
    *,
    results: dict[str, float],
    runs: list[Run],
    outputs: list[str],
    started: float,
) -> dict:
    """Plots memory, writes summary.json and prints the closing summary.

    Args:
        directory: The output directory.
        results: The final numbers, e.g. `{"test accuracy": 0.95}`.
        runs: The training runs, in order. One memory plot is written per
            run: `memory.png`, or `memory_<name>.png` for several.
        outputs: The files the script wrote.
        started: `time.time()` when the script started.

    Returns:
        What was written to summary.json.
    """
    outputs = list(outputs)
    reports = []
    for run in runs:
        suffix = "" if len(runs) == 1 else "_" + run.name.replace(" ", "_")
        plot_path = os.path.join(directory, f"memory{suffix}.png")
        try:
            run.monitor.plot(plot_path)
            outputs.append(plot_path)
        except (ImportError, ValueError) as err:
            logging.warning("No memory plot for %s: %s", run.name, err)
        reports.append(_report(run))
    summary_path = os.path.join(directory, "summary.json")
    outputs.append(summary_path)
    summary = {
        "results": results,
        "dtype_policy": keras.config.dtype_policy().name,
        "runs": reports,
        "outputs": outputs,
        "wall_time_s": round(time.time() - started, 1),
    }
    with open(summary_path, "w") as f:
        json.dump(summary, f, indent=2)
    _print_summary(summary, several_runs=len(runs) > 1)
    return summary


def _report(run: Run) -> dict:
    peaks, limits, sources = {}, {}, {}
    for sample in run.monitor.samples:
        peaks[sample.device] = max(peaks.get(sample.device, 0), sample.peak_mb)
        limits[sample.device] = sample.limit_mb
        sources[sample.device] = sample.source
    return {
        "name": run.name,
        "epochs": len(run.history.epoch),
        "batch_size": getattr(run.history, "batch_size", None),
        "accumulation_steps": run.accumulation_steps,
        "peak_memory_mb": {d: round(mb, 1) for d, mb in peaks.items()},
        "memory_limit_mb": limits,
        # "allocator", or "process_rss" where the CPU keeps no statistics.
        "memory_source": sources,
        "oom_recoveries": [
            dataclasses.asdict(event)
            for event in getattr(run.history, "oom_events", [])
        ],
    }


def _print_summary(summary: dict, several_runs: bool) -> None:
    lines = ["", "Summary"]
    lines += [
        f"  {name}: {value:.4f}" for name, value in summary["results"].items()
    ]
    for report in summary["runs"]:
        indent = "  "
        if several_runs:
            lines.append(f"  {report['name']}:")
            indent = "    "
        for device, peak in report["peak_memory_mb"].items():
            limit = report["memory_limit_mb"][device]
            of = f" of {limit:.0f} MB" if limit else ""
            rss = report["memory_source"][device] == "process_rss"
            kind = " (process RSS)" if rss else ""
            lines.append(
                f"{indent}peak memory on {device}{kind}: {peak:.1f} MB{of}"
            )
        events = report["oom_recoveries"]
        # A pre-flight event records an error predicted, not suffered.
        suffered = [e for e in events if e["phase"] != "preflight"]
        lines.append(f"{indent}out-of-memory recoveries: {len(suffered)}")
        for event in events:
            lines.append(f"{indent}  {tfmemsafe.OOMEvent(**event)}")
        if report["batch_size"] is not None:
            steps = report["accumulation_steps"] or 1
            lines.append(
                f"{indent}batch size: {report['batch_size']}"
                + (f" x {steps} accumulation steps" if steps > 1 else "")
            )
    lines.append(f"  wall time: {summary['wall_time_s']:.0f} s")
    lines.append("  outputs: " + ", ".join(summary["outputs"]))
    print("\n".join(lines), flush=True)
