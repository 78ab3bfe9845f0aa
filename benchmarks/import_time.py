"""What `import tfmemsafe` adds to importing TensorFlow and Keras.

Each variant runs in a fresh Python process, alternating, several times;
the table shows medians and the difference. Target: at most 0.3 s added.

    python benchmarks/import_time.py --repeats=7
"""

import statistics
import subprocess
import sys

from absl import app
from absl import flags

_REPEATS = flags.DEFINE_integer("repeats", 7, "Runs of each variant.")

_VARIANTS = {
    "tensorflow + keras": "import tensorflow, keras",
    "tensorflow + keras + tfmemsafe": "import tensorflow, keras, tfmemsafe",
}
_TIMER = (
    "import time; start = time.perf_counter(); {statement}; "
    "print(time.perf_counter() - start)"
)


def _time_import(statement: str) -> float:
    output = subprocess.run(
        [sys.executable, "-c", _TIMER.format(statement=statement)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return float(output.strip().splitlines()[-1])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    times = {name: [] for name in _VARIANTS}
    _time_import(_VARIANTS["tensorflow + keras"])  # warm the file cache
    for _ in range(_REPEATS.value):
        for name, statement in _VARIANTS.items():
            times[name].append(_time_import(statement))
    base = statistics.median(times["tensorflow + keras"])
    print(f"Medians of {_REPEATS.value} fresh processes per variant.")
    print("| import | median s | added s | ratio |")
    print("| --- | --- | --- | --- |")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(
            f"| {name} | {median:.2f} | {median - base:+.2f} | "
            f"{median / base:.2f} |"
        )


if __name__ == "__main__":
    app.run(main)
