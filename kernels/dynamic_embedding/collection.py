"""Many dynamic embedding tables, one per feature, served and trained together.

    tables = DynamicEmbeddingCollection({"user": EmbeddingConfig(dim=64), "item": EmbeddingConfig(dim=64)}, "cuda")
    embs = tables.lookup({"user": user_ids, "item": item_ids})      # name -> (N_f, dim)
    ...loss.backward() through embs (leaves with requires_grad)...
    tables.apply_gradients({"user": user_ids, ...}, {"user": embs["user"].grad, ...})

Each feature keeps its own DynamicEmbedding: its own capacity, eviction, statistics and
dumps (`tables["user"]`). Tables that can share launches form groups (table_group.py):
one launch per kernel for all of a group's tables; tiered tables (device_capacity) form
groups of their own (tiered_group.py). Other tables are served one by one by their
DynamicEmbedding, with the same results. `prefetch` moves the next batch's host rows of
tiered tables to the device ahead of its lookup, as DynamicEmbedding.prefetch.

Features and tables: by default each table is one feature of its name. `features` maps
feature names to tables instead, several features sharing one table (as one id space read
by several inputs), each in a mode:

    read_write   looks up (with train: inserts and bumps scores) and trains (the default)
    read_only    looks up without inserting or bumping scores; its gradients are ignored
    write_first  as read_write, but an id's gradient counts only from the first feature of
                 the table (in the collection's feature order) that holds the id in the call

A call joins each table's features' ids into one lookup (read-only features' ids into a
second one, without train), so shared tables are grouped as any other.
"""
from dataclasses import dataclass

import torch

from .embedding import DynamicEmbedding, EmbeddingConfig, TableStats
from .table_group import MAX_GROUP, TableGroup, fusable
from .tiered_group import TieredTableGroup

MODE_READ_WRITE, MODE_READ_ONLY, MODE_WRITE_FIRST = "read_write", "read_only", "write_first"
FEATURE_MODES = (MODE_READ_WRITE, MODE_READ_ONLY, MODE_WRITE_FIRST)


@dataclass(frozen=True)
class FeatureConfig:
    """A feature: the table it reads and its mode (FEATURE_MODES, the module docstring)."""

    table: str
    mode: str = MODE_READ_WRITE

    def __post_init__(self):
        if self.mode not in FEATURE_MODES:
            raise ValueError(f"unknown feature mode {self.mode!r}; choose from {FEATURE_MODES}")


class DynamicEmbeddingCollection:
    """One DynamicEmbedding per table; tables that can share launches do (see above)."""

    def __init__(
        self, configs: dict[str, EmbeddingConfig], device: torch.device | str = "cpu",
        features: dict[str, FeatureConfig] | None = None,
    ):
        self.tables = {name: DynamicEmbedding(c, device) for name, c in configs.items()}
        self.features = features if features is not None else {n: FeatureConfig(n) for n in configs}
        unknown = {f.table for f in self.features.values()} - set(self.tables)
        if unknown:
            raise KeyError(f"features read tables {sorted(unknown)} that are not in the collection: {sorted(self.tables)}")
        by_layout: dict = {}
        for name, emb in self.tables.items():
            if fusable(emb):
                c = emb.config
                by_layout.setdefault((c.dim, c.optimizer, c.bucket_size, c.promote_on_miss, emb.host is not None), []).append(name)
        self.groups = [
            (TieredTableGroup if tiered else TableGroup)(names[i : i + MAX_GROUP], [self.tables[n] for n in names[i : i + MAX_GROUP]])
            for (*_, tiered), names in by_layout.items() for i in range(0, len(names), MAX_GROUP)
        ]
        grouped = {n for g in self.groups for n in g.names}
        self.single = [n for n in self.tables if n not in grouped]  # served one by one
        self._joined: dict = {}  # per table: the last call's feature ids and their join

    def __getitem__(self, name: str) -> DynamicEmbedding:
        return self.tables[name]

    def set_epoch(self, epoch: int) -> None:
        for emb in self.tables.values():
            emb.epoch = epoch

    def _check(self, features: dict) -> None:
        unknown = set(features) - set(self.features)
        if unknown:
            raise KeyError(f"no table for features {sorted(unknown)}; features: {sorted(self.features)}")

    # ---- features → tables ----------------------------------------------------------------
    def _by_table(self, ids: dict[str, torch.Tensor], read_only: bool) -> dict[str, list[str]]:
        """The features in ids of each table, in the collection's feature order: the
        read-only ones, or the others."""
        out: dict[str, list[str]] = {}
        for name, f in self.features.items():
            if name in ids and (f.mode == MODE_READ_ONLY) == read_only:
                out.setdefault(f.table, []).append(name)
        return out

    def _join(self, table: str, names: list[str], ids: dict[str, torch.Tensor]) -> torch.Tensor:
        """One table's feature ids as one tensor: the feature's own for one feature; else
        their concatenation, the same tensor again for the same feature tensors (so that an
        update reuses its lookup's routing)."""
        parts = tuple(ids[n] for n in names)
        if len(parts) == 1:
            return parts[0]
        hit = self._joined.get(table)
        if hit is not None and len(hit[0]) == len(parts) and all(a is b for a, b in zip(hit[0], parts)):
            return hit[1]
        joined = torch.cat([p.reshape(-1) for p in parts])
        self._joined[table] = (parts, joined)
        return joined

    def _split(self, rows: dict[str, torch.Tensor], by_table: dict[str, list[str]], ids: dict) -> dict[str, torch.Tensor]:
        out = {}
        for table, names in by_table.items():
            if len(names) == 1:
                out[names[0]] = rows[table]
            else:
                out.update(zip(names, rows[table].split([ids[n].numel() for n in names])))
        return out

    def lookup(
        self, ids: dict[str, torch.Tensor], train: bool = True, scores: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Embeddings (N_f, dim) for each feature's int64 ids (N_f,), as
        DynamicEmbedding.lookup does per table (read-only features: without train).
        scores: per feature, the (N_f,) scores of a table under the custom policy."""
        self._check(ids)
        scores = scores or {}
        out = {}
        for read_only in (False, True):
            by_table = self._by_table(ids, read_only)
            if by_table:
                joined = {t: self._join(t, names, ids) for t, names in by_table.items()}
                joined_scores = {
                    t: torch.cat([scores[n].reshape(-1) for n in names]) if len(names) > 1 else scores[names[0]]
                    for t, names in by_table.items() if all(n in scores for n in names)
                }
                out.update(self._split(self._lookup_tables(joined, train and not read_only, joined_scores), by_table, ids))
        return {n: out[n] for n in ids}

    def apply_gradients(self, ids: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
        """One optimizer step for every table read by a trained feature in ids (gradients
        of duplicate ids summed; write_first and read_only as the module docstring says).
        The update of the ids a training lookup has just served reuses its routing."""
        self._check(ids)
        if set(grads) != set(ids):
            raise KeyError(f"gradients for {sorted(grads)} but ids for {sorted(ids)}")
        by_table = self._by_table(ids, read_only=False)
        table_ids = {t: self._join(t, names, ids) for t, names in by_table.items()}
        table_grads = {t: self._table_grads(t, names, table_ids[t], ids, grads) for t, names in by_table.items()}
        self._apply_tables(table_ids, table_grads)

    def _table_grads(self, table: str, names: list[str], joined_ids: torch.Tensor, ids: dict, grads: dict) -> torch.Tensor:
        """A table's features' gradients joined, write_first features' rows zeroed where an
        earlier feature of the table holds the id (the id's segment then sums the first
        feature's gradients alone); joined_ids: the features' ids as _join joined them.
        Nothing here waits for the GPU."""
        if len(names) == 1:
            return grads[names[0]]
        dim = self.tables[table].dim
        joined = torch.cat([grads[n].reshape(ids[n].numel(), dim) for n in names])
        later = [i for i, n in enumerate(names) if i > 0 and self.features[n].mode == MODE_WRITE_FIRST]
        if not later:
            return joined
        dev = joined.device
        # per lane, its feature and whether that is a later write_first one (filled on the
        # device: a host list copied there would wait)
        feature = torch.cat([torch.full((ids[n].numel(),), i, dtype=torch.int64, device=dev) for i, n in enumerate(names)])
        later_lane = torch.cat([torch.full((ids[n].numel(),), i in later, device=dev) for i, n in enumerate(names)])
        keys = joined_ids.to(dev)
        # each lane's id's first feature, without waiting for the GPU (torch.unique would):
        # a stable sort keeps an id's lanes in feature order, so its first lane is its run's
        order = torch.argsort(keys, stable=True)
        sorted_keys = keys[order]
        starts = torch.ones_like(sorted_keys, dtype=torch.bool)
        starts[1:] = sorted_keys[1:] != sorted_keys[:-1]
        lanes = torch.arange(keys.numel(), device=dev)
        run_start = torch.where(starts, lanes, 0).cummax(0).values
        first = torch.empty_like(feature)
        first[order] = feature[order][run_start]
        return joined.masked_fill((later_lane & (first < feature))[:, None], 0.0)

    # ---- tables ---------------------------------------------------------------------------
    def _ids_of(self, group: TableGroup, ids: dict) -> list[torch.Tensor]:
        return [ids.get(n, group.empty) for n in group.names]

    def _lookup_tables(self, ids: dict[str, torch.Tensor], train: bool, scores: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for g in self.groups:
            if any(n in ids for n in g.names):
                out.update(zip(g.names, g.lookup(self._ids_of(g, ids), train, [scores.get(n) for n in g.names])))
        for n in self.single:
            if n in ids:
                out[n] = self.tables[n].lookup(ids[n], train, scores=scores.get(n))
        return out

    def _apply_tables(self, ids: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
        for g in self.groups:
            if any(n in ids for n in g.names):
                zeros = torch.empty(0, g.dim, device=g.device)
                g.apply_gradients(self._ids_of(g, ids), [grads.get(n, zeros) for n in g.names], [n in ids for n in g.names])
        for n in self.single:
            if n in ids:
                self.tables[n].apply_gradients(ids[n], grads[n])

    def prefetch(self, ids: dict[str, torch.Tensor]) -> None:
        """Moves the host rows of each feature's ids (the next batch's, looked up after
        this step's update) to the device ahead of their lookup, as
        DynamicEmbedding.prefetch does table by table; tables without a host tier are
        left alone."""
        self._check(ids)
        # (joined without _join's memory, which keeps this step's ids for its update)
        by_table = {
            t: torch.cat([ids[n].reshape(-1) for n in names]) if len(names) > 1 else ids[names[0]]
            for t, names in self._by_table(ids, read_only=False).items()
        }
        for g in self.groups:
            if isinstance(g, TieredTableGroup) and any(n in by_table for n in g.names):
                g.prefetch(self._ids_of(g, by_table))
        for n in self.single:
            if n in by_table:
                self.tables[n].prefetch(by_table[n])

    def stats(self) -> dict[str, TableStats]:
        return {n: emb.stats() for n, emb in self.tables.items()}

    def metrics(self, prefix: str = "emb_") -> dict[str, float]:
        """Every table's statistics, keyed <prefix><table>_<name>."""
        return {k: v for n, s in self.stats().items() for k, v in s.as_metrics(f"{prefix}{n}_").items()}
