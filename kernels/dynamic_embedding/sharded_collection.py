"""Named dynamic embedding tables sharded over a process group, looked up and trained
together: the tables of one model (an item table and its side features' tables).

    tables = ShardedDynamicEmbeddingCollection({"item": item_config, "genre": genre_config}, "cuda")
    rows = tables.lookup({"item": item_ids, "genre": genre_ids})     # name -> (N_f, dim)
    tables.apply_gradients({"item": item_ids, ...}, {"item": grad, ...})
    dump(tables["genre"], path)                                       # each table dumps alone

This rank's tables are one DynamicEmbeddingCollection, so on one rank the features share
its launches; a collection of one table is served by that table's own lookup and update
(a group of one saves no launch, and its routing costs the host more per call). With
several ranks each feature routes its ids to their owners as
ShardedDynamicEmbedding does (`tables[name]` is that feature's sharded view), and the
owners serve them table by table. Every rank makes the same calls with the same features.
"""
import torch

from .collection import DynamicEmbeddingCollection
from .embedding import EmbeddingConfig, ShardedDynamicEmbedding, TableStats


class ShardedDynamicEmbeddingCollection:
    def __init__(self, configs: dict[str, EmbeddingConfig], device: torch.device | str = "cpu", group=None):
        self.local = DynamicEmbeddingCollection(configs, device)
        self.tables = {n: ShardedDynamicEmbedding(c, device, group, local=self.local[n]) for n, c in configs.items()}
        first = next(iter(self.tables.values()))
        self.world_size, self.rank, self.group = first.world_size, first.rank, group

    def __getitem__(self, name: str) -> ShardedDynamicEmbedding:
        return self.tables[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tables

    def lookup(self, ids: dict[str, torch.Tensor], train: bool = True) -> dict[str, torch.Tensor]:
        """(N_f, dim) rows for each feature's int64 ids (N_f,); a collective with several ranks."""
        if self.world_size == 1 and len(self.tables) > 1:
            return self.local.lookup(ids, train)
        self.local._check(ids)
        return {n: self.tables[n].lookup(x, train) for n, x in ids.items()}

    def apply_gradients(self, ids: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
        """One optimizer step per feature in ids, with the mean of the ranks' gradients."""
        if self.world_size == 1 and len(self.tables) > 1:
            return self.local.apply_gradients(ids, grads)
        self.local._check(ids)
        if set(grads) != set(ids):
            raise KeyError(f"gradients for {sorted(grads)} but ids for {sorted(ids)}")
        for n, x in ids.items():
            self.tables[n].apply_gradients(x, grads[n])

    def set_epoch(self, epoch: int) -> None:
        self.local.set_epoch(epoch)

    def stats(self) -> dict[str, TableStats]:
        """Each table's statistics summed over ranks (a collective)."""
        return {n: t.stats() for n, t in self.tables.items()}
