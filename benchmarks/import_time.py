"""What `import tfmemsafe` adds to importing TensorFlow and Keras.

Each fresh Python process imports TensorFlow and Keras, then tfmemsafe
(which also runs its import-time `configure()`), timing each step. Timing
both in the same process makes the difference immune to the machine's
load, which swamps it when two sets of processes are compared. Target:
at most 0.3 s added.

    python benchmarks/import_time.py --repeats=7
"""

import json
import statistics
import subprocess
import sys

from absl import app
from absl import flags

_REPEATS = flags.DEFINE_integer("repeats", 7, "Fresh processes to time.")

_TIMER = """
import json, time
start = time.perf_counter()
import tensorflow, keras
middle = time.perf_counter()
import tfmemsafe
end = time.perf_counter()
print(json.dumps([middle - start, end - middle]))
"""


def _time_imports() -> list[float]:
    output = subprocess.run(
        [sys.executable, "-c", _TIMER],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    _time_imports()  # Warm the file cache.
    runs = [_time_imports() for _ in range(_REPEATS.value)]
    base = statistics.median(run[0] for run in runs)
    added = statistics.median(run[1] for run in runs)
    print(f"Medians of {_REPEATS.value} fresh processes.")
    print("| import | median s | ratio to tensorflow + keras |")
    print("| --- | --- | --- |")
    print(f"| tensorflow + keras | {base:.2f} | 1.00 |")
    ratio = added / base
    print(f"| then tfmemsafe (with configure()) | {added:.3f} | {ratio:.3f} |")


if __name__ == "__main__":
    app.run(main)
