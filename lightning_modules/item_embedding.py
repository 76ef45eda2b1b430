"""Items' embeddings as the HSTU model reads them: each item's row in the dynamic item
table, plus, with item side features, the mean of its genres' rows (kernels.pooling) from a
genre table in the same collection (ShardedDynamicEmbeddingCollection).

Training, validation, the pipeline's evaluation and the exported Recommender all go
through `lookup`, so an item is embedded the same way everywhere. An item without genres
(or unknown to the features) is its row alone.
"""
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.dynamic_embedding import ShardedDynamicEmbedding, ShardedDynamicEmbeddingCollection, TableStats, dump, load
from kernels.pooling import pool

from .config import HSTUConfig
from .item_features import ItemFeatures

ITEM, GENRE = "item", "genre"  # the tables' names


@dataclass
class ItemLookup:
    """A batch's item embeddings and what produced them: the ids each table served and the
    rows it returned (leaves: a training lookup's rows collect their gradients)."""

    embeddings: torch.Tensor  # (N, D)
    ids: dict[str, torch.Tensor]
    rows: dict[str, torch.Tensor]


class ItemEmbedding:
    """The item table (and the genre table where `features` is given), sharded over the
    process group; every rank makes the same calls."""

    def __init__(self, config: HSTUConfig, device: torch.device | str = "cpu", features: ItemFeatures | None = None, group=None):
        configs = {ITEM: config.embedding_config()}
        if features is not None:
            configs[GENRE] = config.genre_embedding_config()
        self.tables = ShardedDynamicEmbeddingCollection(configs, device, group)
        self.device = self.tables[ITEM].local.device
        self.features = features.to(self.device) if features is not None else None
        self._static_wanted: tuple | None = None  # (ids, version, tables' ids, bags) of the last static lookup

    @property
    def item_table(self) -> ShardedDynamicEmbedding:
        return self.tables[ITEM]

    def lookup(self, ids: torch.Tensor, train: bool = False, item_rows=None, static: bool = False) -> ItemLookup:
        """Embeddings of item ids (N,). train: rows are created and counted as training
        uses, and returned as leaves that require gradients (see apply_gradients).
        item_rows: a function ids → item rows that serves them instead of the item table
        (serving's inference table; the genre table stays this one's). static: ids is the
        same unchanged tensor at every static call (the catalog), on every rank alike: its
        genres and the tables' routing are kept (ShardedDynamicEmbeddingCollection.lookup)."""
        ids = ids.to(self.device)
        want, bags = self._wanted(ids, static)
        if item_rows is None:
            rows = self.tables.lookup(want, train, static=static)
        else:
            rows = self.tables.lookup({n: i for n, i in want.items() if n != ITEM}, train) | {ITEM: item_rows(ids)}
        if train:
            rows = {n: r.requires_grad_(True) for n, r in rows.items()}
        emb = rows[ITEM]
        if bags is not None:
            emb = emb + pool(rows[GENRE], *bags, "mean")
        return ItemLookup(emb, want, rows)

    def _wanted(self, ids: torch.Tensor, static: bool) -> tuple[dict, tuple | None]:
        """Each table's ids for these items, and with features their genres' bags (each
        genre's place among the genre ids, bag offsets); kept for static ids."""
        kept = self._static_wanted
        if static and kept is not None and kept[0] is ids and kept[1] == ids._version:
            return kept[2], kept[3]
        want, bags = {ITEM: ids}, None
        if self.features is not None:
            genre_ids, bag_offsets = self.features.bags(ids)
            want[GENRE], bag_index = torch.unique(genre_ids, return_inverse=True)
            bags = (bag_index, bag_offsets)
        if static:
            self._static_wanted = (ids, ids._version, want, bags)
        return want, bags

    def embed(self, ids: torch.Tensor, item_rows=None) -> torch.Tensor:
        """(N, D) embeddings for inference (no rows created, no gradients); item_rows as
        in lookup."""
        with torch.no_grad():
            return self.lookup(ids, train=False, item_rows=item_rows).embeddings

    def apply_gradients(self, looked: ItemLookup) -> None:
        """One optimizer step of every table from the gradients in a training lookup's rows
        (zeros for rows the loss did not reach)."""
        grads = {n: r.grad if r.grad is not None else torch.zeros_like(r) for n, r in looked.rows.items()}
        self.tables.apply_gradients(looked.ids, grads)

    # ---- dumps: the item table's at `path` (where a model without features has it), each
    # other table's in the subdirectory of its name -----------------------------------------
    def dump(self, path: str | Path, metadata: dict | None = None, replace: bool = False) -> None:
        """Collective. The item table's dump first: it replaces `path` whole."""
        for name, table in self.tables.tables.items():
            dump(table, dump_path(path, name), metadata=metadata, replace=replace)

    def load(self, path: str | Path, item_table: bool = True) -> None:
        """Loads every table's dump; without item_table, the tables besides the item one
        (serving reads the item rows from its inference table)."""
        for name, table in self.tables.tables.items():
            if item_table or name != ITEM:
                load(table, dump_path(path, name))

    def set_epoch(self, epoch: int) -> None:
        self.tables.set_epoch(epoch)

    def stats(self) -> dict[str, TableStats]:
        return self.tables.stats()

    def metrics(self, prefix: str) -> dict[str, float]:
        """Every table's statistics: the item table's under `prefix`, another's under
        `<prefix><name>_`."""
        return {
            k: v for n, s in self.stats().items() for k, v in s.as_metrics(prefix if n == ITEM else f"{prefix}{n}_").items()
        }


def dump_path(path: str | Path, name: str) -> Path:
    return Path(path) if name == ITEM else Path(path) / name
