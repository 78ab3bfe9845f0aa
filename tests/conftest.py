"""The suite's child processes fork from a process with TensorFlow imported.

Each real out-of-memory test runs in a child process, and importing
TensorFlow and Keras there costs several seconds of CPU per child. Tests
of what happens at import (runtime_test) ask for a fresh process with
`TFMEMSAFE_TESTING_PRELOAD=""` in the child's environment.
"""

import os

os.environ.setdefault("TFMEMSAFE_TESTING_PRELOAD", "1")
