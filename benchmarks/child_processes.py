"""Child processes of `tfmemsafe.testing`: fresh against forked.

Each child trains a small conv net for two steps under a 300 MB cap, as
a real out-of-memory test's child does, started by
`testing.run_with_memory_cap` once as a fresh process and once forked
from a server that has TensorFlow and Keras imported
(`TFMEMSAFE_TESTING_PRELOAD=1`), in turn. Each child reports its own
CPU time (user + system, import included); the parent times each call.
The forked children's server imports once, before the first is timed.

    python benchmarks/child_processes.py --repeats=7
"""

import resource
import statistics
import time

from absl import app
from absl import flags

from tfmemsafe import testing

_REPEATS = flags.DEFINE_integer("repeats", 7, "Children of each kind.")
_CAP_MB = 300


def train_two_steps() -> float:
    """A capped test's child: import (this module's), build, two steps;
    its CPU seconds."""
    x, y = testing.random_images(64, classes=4)
    model = testing.reference_model("conv_net", (32, 32, 3))
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _child(preload: str) -> tuple[float, float]:
    start = time.perf_counter()
    cpu = testing.run_with_memory_cap(
        train_two_steps,
        _CAP_MB,
        env={"TFMEMSAFE_TESTING_PRELOAD": preload},
    )
    return cpu, time.perf_counter() - start


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    _child("1")  # Starts the server and warms the file cache.
    runs = {"fresh": [], "forked": []}
    for _ in range(_REPEATS.value):
        runs["fresh"].append(_child(""))
        runs["forked"].append(_child("1"))
    print(f"Medians of {_REPEATS.value} children of each kind, in turn.")
    print("| child | CPU s | wall s | CPU ratio | wall ratio |")
    print("| --- | --- | --- | --- | --- |")
    fresh_cpu = statistics.median(cpu for cpu, _ in runs["fresh"])
    fresh_wall = statistics.median(wall for _, wall in runs["fresh"])
    for name, timings in runs.items():
        cpu = statistics.median(c for c, _ in timings)
        wall = statistics.median(w for _, w in timings)
        print(
            f"| {name} | {cpu:.2f} | {wall:.2f} | {cpu / fresh_cpu:.2f} "
            f"| {wall / fresh_wall:.2f} |"
        )


if __name__ == "__main__":
    app.run(main)
