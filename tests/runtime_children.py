"""Work run in fresh processes by runtime_test.

Kept apart from the test module, which imports tfmemsafe at its top: these
functions import it themselves, after setting up what they test. Keras
alone does not import tfmemsafe, so importing it first is safe.
"""

import dataclasses

import keras


def import_and_report(set_policy_first=None):
    """Imports tfmemsafe in a fresh process and reports its configuration."""
    if set_policy_first:
        keras.config.set_dtype_policy(set_policy_first)
    import tfmemsafe

    config = tfmemsafe.runtime_config()
    return {
        "config": dataclasses.asdict(config) if config else None,
        "policy": keras.config.dtype_policy().name,
    }


def configure_and_report(precision):
    """Configures twice and reports both results and what is in force."""
    import tfmemsafe

    first = tfmemsafe.configure(precision=precision)
    second = tfmemsafe.configure(precision=precision)
    return {
        "first": dataclasses.asdict(first),
        "second": dataclasses.asdict(second),
        "current": dataclasses.asdict(tfmemsafe.runtime_config()),
        "policy": keras.config.dtype_policy().name,
    }
