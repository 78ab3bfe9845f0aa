"""Keeps TensorFlow's INFO logs, and so its allocator dump, out of sight.

After a failed allocation TensorFlow's BFC allocator logs about 1,900
lines of INFO (every bin and chunk it holds) before the one WARNING line
that says it ran out. TensorFlow reads `TF_CPP_MIN_LOG_LEVEL` once, at
its first log message, which it writes while being imported: so this
module, imported by `tfmemsafe/__init__.py` before anything imports
TensorFlow, sets it to 1 (warnings and errors stay) unless the user set
it, or TensorFlow was imported first, or `TFMEMSAFE_AUTOCONFIGURE=0`.
It imports nothing that imports TensorFlow.
"""

from __future__ import annotations

import os
import sys

_TF_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"


def hide_info_logs() -> str:
    """Sets `TF_CPP_MIN_LOG_LEVEL=1` if it can; says what it did."""
    value = os.environ.get(_TF_LOG_LEVEL, "").strip()
    if value:
        return f"{_TF_LOG_LEVEL}={value} was set before tfmemsafe; kept"
    if "tensorflow" in sys.modules:
        return (
            "TensorFlow was imported before tfmemsafe, so its INFO logs "
            "(an allocator dump of ~1,900 lines after each OOM) show; set "
            f"{_TF_LOG_LEVEL}=1 before importing TensorFlow to hide them"
        )
    if os.environ.get("TFMEMSAFE_AUTOCONFIGURE", "").strip().lower() in (
        "0",
        "false",
    ):
        return "TFMEMSAFE_AUTOCONFIGURE=0; left as is"
    os.environ[_TF_LOG_LEVEL] = "1"
    return (
        f"INFO hidden: {_TF_LOG_LEVEL}=1, set by tfmemsafe (warnings and "
        f"errors show; {_TF_LOG_LEVEL}=0 before import shows all)"
    )


# Before `tfmemsafe/__init__.py` imports anything that imports TensorFlow.
DONE = hide_info_logs()
