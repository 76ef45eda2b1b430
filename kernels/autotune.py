"""Autotuning that Triton's interpreter can run: on a device a kernel is tuned over its
configurations; under TRITON_INTERPRET=1 (tests on a CPU), or with HSTU_AUTOTUNE=0 (tests
on a GPU, where tuning every shape would compile every configuration), it runs one."""
import os

import triton

AUTOTUNE_ENV = "HSTU_AUTOTUNE"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def tuning() -> bool:
    return not interpreting() and os.environ.get(AUTOTUNE_ENV, "1") != "0"


def autotuned(kernel, configs: list, interpreter_config, key: list[str], reset_to_zero: list[str] | None = None):
    """kernel tuned over configs by the arguments named in key (interpreter_config alone
    where not tuning). reset_to_zero: outputs that the kernel adds into, zeroed before
    each trial."""
    chosen = configs if tuning() else [interpreter_config]
    return triton.autotune(configs=chosen, key=key, reset_to_zero=reset_to_zero)(kernel)
