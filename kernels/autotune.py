"""Autotuning that Triton's interpreter can run: on a device a kernel is tuned over its
configurations; under TRITON_INTERPRET=1 (tests on a CPU), or with HSTU_AUTOTUNE=0 (tests
on a GPU, where tuning every shape would compile every configuration), it runs one."""
import contextlib
import os

import torch
import triton

from .launch import launch

AUTOTUNE_ENV = "HSTU_AUTOTUNE"


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def tuning() -> bool:
    return not interpreting() and os.environ.get(AUTOTUNE_ENV, "1") != "0"


def config_blocks(config: triton.Config) -> str:
    """A configuration's block sizes joined by x ("64x32"): a test's id for it."""
    return "x".join(str(v) for v in config.kwargs.values())


def config_label(config: triton.Config) -> str:
    """A configuration in a table's words: its block sizes, warps and stages ("64x32, 4
    warps, 3 stages")."""
    return f"{config_blocks(config)}, {config.num_warps} warps, {config.num_stages} stages"


def autotuned(kernel, configs: list, interpreter_config, key: list[str], reset_to_zero: list[str] | None = None):
    """kernel tuned over configs by the arguments named in key (interpreter_config alone
    where not tuning). reset_to_zero: outputs that the kernel adds into, zeroed before
    each trial."""
    chosen = configs if tuning() else [interpreter_config]
    return triton.autotune(configs=chosen, key=key, reset_to_zero=reset_to_zero)(kernel)


class TunedLaunches:
    """Launches of a kernel made by `autotuned`: the first launch of each key goes through
    Triton's autotuner, which tunes (or takes its one configuration) and launches; later
    ones launch the configuration it chose through launch.launch, which costs the host a
    fraction of the autotuner's launch (figures: benchmarks/train_throughput.md)."""

    def __init__(self, tuner):
        self.tuner, self.chosen = tuner, {}

    def __call__(self, grid, args: tuple, constants: dict) -> None:
        """grid: the launch grid from the configuration's parameters; args: the kernel's
        runtime parameters in order; constants: its constexprs but the tuned ones, by name."""
        key = self._key(args, constants)
        config = self.chosen.get(key)
        if config is None:
            self.tuner[grid](*args, **constants)
            self.chosen[key] = self.tuner.best_config
            return
        meta = config.all_kwargs()
        launch(self.tuner.fn, grid(meta), *args, **constants, **meta)

    def _key(self, args: tuple, constants: dict) -> tuple:
        """What the choice depends on: as the autotuner's key (the values of its key
        arguments, runtime or constant, every tensor's dtype), and the constants."""
        named = {**dict(zip(self.tuner.arg_names, args)), **constants}
        return (
            tuple(named[name] for name in self.tuner.keys),
            tuple(a.dtype for a in args if isinstance(a, torch.Tensor)),
            tuple(constants.items()),
        )

    def forget(self) -> None:
        """Drops every choice (the autotuner's too): the next launch of each key tunes again."""
        self.chosen.clear()
        self.tuner.cache.clear()


@contextlib.contextmanager
def tuned_to(*pairs):
    """Within the block, each autotuned kernel of (kernel, configuration) pairs tunes over
    that one configuration (its first launch of each key takes it, untimed): a
    TunedLaunches, or a kernel wrapped by triton.autotune. For tests of every configuration
    (under the interpreter a configuration's blocks run, its warps and stages do not) and
    benchmarks of one. The kernels' own configurations come back after, and their choices
    are dropped."""
    def forget(kernel):
        if isinstance(kernel, TunedLaunches):
            kernel.forget()
        else:
            kernel.cache.clear()

    tuners = [(kernel.tuner if isinstance(kernel, TunedLaunches) else kernel, kernel) for kernel, _ in pairs]
    saved = [tuner.configs for tuner, _ in tuners]
    try:
        for (tuner, kernel), (_, config) in zip(tuners, pairs):
            tuner.configs = [config]
            forget(kernel)
        yield
    finally:
        for (tuner, kernel), configs in zip(tuners, saved):
            tuner.configs = configs
            forget(kernel)
