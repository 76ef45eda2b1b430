"""Host time by section of a training step: named callables wrapped in `perf_counter` pairs,
summed while a window is open.

cProfile follows every thread under Python 3.12, so the data loader's pinning thread mixes
into the main thread's cumulative times, and it slows Python-heavy code most; the torch
profiler slows each launch. These wrappers cost well under a microsecond a call and time
the main thread's calls alone. Sections nest (a lookup inside the training step): each
figure is that section's own wall time, its callees included.
"""
import functools
import importlib
import time
from collections import Counter, defaultdict

# (module, attribute path, label): the `hstu` step's parts, outermost first
TRAINING_STEP_SECTIONS = (
    ("lightning.pytorch.loops.training_epoch_loop", "_TrainingEpochLoop.advance", "Lightning's step, all of it"),
    ("lightning.pytorch.loops.fetchers", "_PrefetchDataFetcher.__next__", "the loader's next batch"),
    ("lightning.pytorch.strategies.strategy", "Strategy.batch_to_device", "the batch moved to the device"),
    ("lightning.pytorch.trainer.call", "_call_callback_hooks", "callbacks' hooks"),
    ("lightning.pytorch.trainer.connectors.logger_connector.logger_connector", "_LoggerConnector.update_train_step_metrics",
     "Lightning's step metrics"),
    ("lightning.pytorch.loops.optimization.manual", "_ManualOptimization.run", "manual optimization: the step, its hooks"),
    ("lightning_modules.module", "HSTULightningModule.training_step", "training_step"),
    ("lightning_modules.item_embedding", "ItemEmbedding.lookup", "item table: lookup"),
    ("kernels.dynamic_embedding.table_group", "TableGroup._settle", "  settling the last growth check"),
    ("kernels.dynamic_embedding.table_group", "TableGroup._route", "  numbering the ids"),
    ("kernels.dynamic_embedding.table_group", "TableGroup._claim", "  claim"),
    ("kernels.dynamic_embedding.table_group", "TableGroup._growth_checks", "    growth check"),
    ("kernels.dynamic_embedding.table_group", "init_rows", "  new rows initialized"),
    ("kernels.dynamic_embedding.table_group", "segment_rows", "  rows of the segments"),
    ("kernels.dynamic_embedding.table_group", "gather_embeddings", "  rows gathered"),
    ("lightning_modules.step_graph", "GraphedTrainingStep.__call__", "step graph: inputs copied, replay"),
    ("lightning_modules.module", "rows_gradient", "rows' gradient from the graph's"),
    ("lightning_modules.module", "catalog_rows_gradient", "catalog rows' gradient from the graph's (several processes)"),
    ("lightning_modules.module", "HSTULightningModule._step", "_step: updates and logs"),
    ("lightning.pytorch.core.optimizer", "LightningOptimizer.step", "  optimizer step (no gradient: a count)"),
    ("lightning_modules.item_embedding", "ItemEmbedding.apply_gradients", "  item table: update"),
    ("kernels.dynamic_embedding.table_group", "update_segments", "    update kernel"),
    ("lightning_modules.module", "HSTULightningModule._log_step", "  logging (waits at logged steps)"),
    ("lightning_modules.item_embedding", "ItemEmbedding.metrics", "    tables' statistics"),
    ("lightning.pytorch.core.module", "LightningModule.log", "    LightningModule.log"),
)


class HostSections:
    """Wraps each (module, attribute path, label) of `sections` (those that exist) and sums
    each one's wall time and calls between start() and stop(); restore() unwraps."""

    def __init__(self, sections=TRAINING_STEP_SECTIONS):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()
        self.labels: list[str] = []
        self._on = False
        self._wrapped: list[tuple] = []
        for module, path, label in sections:
            owner_path, _, name = path.rpartition(".")
            try:
                owner = importlib.import_module(module)
                for part in owner_path.split(".") if owner_path else ():
                    owner = getattr(owner, part)
                original = getattr(owner, name)
            except (ImportError, AttributeError):
                continue  # (another version of a library, or a part this code no longer has)
            own = name in vars(owner)  # (else inherited: restore() deletes the wrapper)
            setattr(owner, name, self._timed(original, label))
            self._wrapped.append((owner, name, original if own else None))
            self.labels.append(label)

    def _timed(self, fn, label: str):
        @functools.wraps(fn)  # (its signature too, which Lightning reads from hooks)
        def timed(*args, **kwargs):
            if not self._on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1
        return timed

    def start(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self._on = True

    def stop(self) -> None:
        self._on = False

    def restore(self) -> None:
        for owner, name, original in reversed(self._wrapped):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._wrapped.clear()

    def per_step(self, steps: int) -> dict[str, float]:
        """ms per step of each section that ran, in the sections' order."""
        return {label: 1000 * self.seconds[label] / steps for label in self.labels if self.calls[label]}

    def table(self, steps: int) -> str:
        return "\n".join(f"  {label:<40}{ms:8.3f} ms  ({self.calls[label] / steps:.2f} calls)" for label, ms in self.per_step(steps).items())
