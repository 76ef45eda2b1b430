"""The HSTU model, the loss, the metrics, and a training step on an empty batch."""
import warnings
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from conftest import sequence_batch
from lightning.pytorch.loggers import Logger

from lightning_modules.callbacks import LOSS
from lightning_modules.config import HSTUConfig, preset
from lightning_modules.data import PackedBatch, jagged_batch, padded, unpacked
from lightning_modules.data_module import SequenceDataModule
from lightning_modules.datasets import prepare
from lightning_modules import hstu
from lightning_modules.hstu import HSTU, KernelLayerNorm
from lightning_modules.losses import catalog_softmax_loss, sampled_softmax_loss
from lightning_modules.module import HSTULightningModule, count_optimizer_step
from lightning_modules.sigterm import DeferredSigtermBroadcast

SMALL = HSTUConfig(num_blocks=2, num_heads=2, attention_dim=8, linear_dim=8, embedding_dim=16, max_seq_len=12, num_negatives=5, batch_size=4)


def test_presets_are_the_papers_ml1m_settings():
    base, large = preset("hstu"), preset("hstu-large")
    assert (base.num_blocks, base.num_heads, base.attention_dim, base.embedding_dim) == (2, 1, 50, 50)
    assert (large.num_blocks, large.num_heads, large.attention_dim, large.linear_dim) == (8, 2, 25, 25)
    for c in (base, large):
        assert (c.max_seq_len, c.dropout, c.lr, c.betas, c.batch_size, c.temperature) == (200, 0.2, 4e-3, (0.9, 0.98), 128, 0.1)


def test_an_item_table_smaller_than_the_initial_allocation_starts_whole():
    table = preset("hstu").override(embedding_max_capacity=1000).embedding_config()
    assert (table.capacity, table.max_capacity) == (1000, 1000)
    assert preset("hstu").embedding_config().capacity == preset("hstu").embedding_capacity


def test_output_is_causal_normalized_and_sequences_are_independent():
    model = HSTU(SMALL).eval()
    emb, ts, offsets = sequence_batch([10, 6, 0, 12])
    with torch.no_grad():
        out = model(emb, ts, offsets)
        torch.testing.assert_close(out.norm(dim=-1), torch.ones(len(emb)))
        changed = emb.clone()
        changed[7:10] = torch.randn(3, 16)  # sequence 0's future after row 6
        out2 = model(changed, ts, offsets)
        torch.testing.assert_close(out2[:7], out[:7])  # its past and every other sequence unchanged
        torch.testing.assert_close(out2[10:], out[10:])
        assert not torch.allclose(out2[7:10], out[7:10])
        # each sequence alone gives what it gives in the batch
        for b in range(4):
            start, end = int(offsets[b]), int(offsets[b + 1])
            alone = model(emb[start:end], ts[start:end], torch.tensor([0, end - start]))
            torch.testing.assert_close(alone, out[start:end])
        assert model(emb[:0], ts[:0], torch.zeros(1, dtype=torch.int64)).shape == (0, 16)


def test_jagged_batches_name_the_rows_the_model_reads():
    samples = [(np.array([10, 11, 12]), np.array([1, 2, 3])), (np.zeros(0, np.int64), np.zeros(0, np.int64)),
               (np.array([20]), np.array([4])), (np.array([30, 31]), np.array([5, 6]))]
    batch = jagged_batch(samples)
    assert batch["item_ids"].tolist() == [10, 11, 12, 20, 30, 31] and batch["timestamps"].tolist() == [1, 2, 3, 4, 5, 6]
    assert batch["offsets"].tolist() == [0, 3, 3, 4, 6] and batch["lengths"].tolist() == [3, 0, 1, 2]
    assert batch["input_rows"].tolist() == [0, 1, 4]  # 10 -> 11, 11 -> 12, 30 -> 31
    assert batch["input_offsets"].tolist() == [0, 2, 2, 2, 3]
    assert padded(batch["item_ids"], batch["lengths"]).tolist() == [[10, 11, 12], [0, 0, 0], [20, 0, 0], [30, 31, 0]]
    empty = jagged_batch([])
    assert empty["item_ids"].shape == (0,) and empty["offsets"].tolist() == [0] and empty["input_rows"].numel() == 0


def test_the_loader_packs_each_batch_into_one_array_and_unpacking_gives_the_jagged_batch(tmp_path):
    prepare("synthetic", tmp_path, synthetic_users=40, seed=0)
    data = SequenceDataModule(tmp_path, max_len=9, batch_size=16, num_workers=2)
    data.setup("fit")
    packed = list(data.train_dataloader())
    # one int64 array per batch (a pinned tensor where the loader pins)
    assert len(packed) == 3 and all(isinstance(b, PackedBatch) and b.to("cpu").values.dtype == torch.int64 for b in packed)
    seen = []
    for b in packed:
        got = data.on_after_batch_transfer(b.to("cpu"), 0)  # as Lightning moves it
        # the batch's samples, read back from its offsets, make the same jagged batch
        bounds = got["offsets"].tolist()
        samples = [(got["item_ids"][s:e].numpy(), got["timestamps"][s:e].numpy()) for s, e in zip(bounds, bounds[1:])]
        want = jagged_batch(samples)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        # every array 16-byte aligned, as Triton's kernels are compiled for its pointers,
        # whatever the sizes of the arrays before it
        base = got["item_ids"].data_ptr()
        assert base % 16 == 0 and all((got[k].data_ptr() - base) % 16 == 0 for k in got)
        seen += [(tuple(i), tuple(t)) for i, t in samples]
    assert sorted(seen) == sorted((tuple(i), tuple(t)) for i, t in (data.train[j] for j in range(len(data.train))))
    assert unpacked(want) is want  # a batch that is not packed passes as it is


def padded_hstu(model: HSTU, emb, ts, lengths):
    """The model's computation written out on padded (B, L, D) batches, each block's
    attention as one dense (B, H, L, L) product: what the jagged model must equal."""
    c = model.config
    B, L, D = emb.shape
    mask = torch.arange(L)[None, :] < lengths[:, None]
    x = emb * D**0.5 + model.positions.weight[:L][None]
    pos = torch.arange(L)
    rel = (pos[None, :] - pos[:, None]).clamp(-(c.max_seq_len - 1), c.max_seq_len - 1) + c.max_seq_len - 1
    gap = (ts[:, :, None] - ts[:, None, :]).abs().clamp(min=1).double()
    bucket = torch.floor(torch.log(gap) / 0.301).long().clamp(0, c.num_time_buckets)
    allowed = torch.ones(L, L, dtype=torch.bool).tril()[None] & mask[:, None, :]
    H, dqk, dv = c.num_heads, c.attention_dim, c.linear_dim
    for block in model.blocks:
        u, v, q, k = torch.nn.functional.silu(block.uvqk(block.input_norm(x))).split([H * dv, H * dv, H * dqk, H * dqk], -1)
        q, k, v = (t.view(B, L, H, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) + (block.bias.position[rel][None] + block.bias.time[bucket])[:, None]
        attn = torch.nn.functional.silu(scores) / c.max_seq_len * allowed[:, None]
        out = (attn @ v).transpose(1, 2).reshape(B, L, H * dv)
        x = x + block.output(block.attn_norm(out) * u)
    return torch.nn.functional.normalize(x, dim=-1)[mask]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_the_jagged_model_is_the_padded_computation(backend):
    model = HSTU(SMALL, attention_backend=backend).eval()
    lengths = torch.tensor([1, 3, 12, 5, 0, 7, 12, 2])
    emb, ts, offsets = sequence_batch(lengths.tolist(), seed=1)
    want = padded_hstu(model, padded(emb, lengths), padded(ts, lengths), lengths)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs interpreted on a CPU
    with torch.no_grad():
        got = model.to(device)(emb.to(device), ts.to(device), offsets.to(device))
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-4)


def test_a_model_without_blocks_is_refused():
    with pytest.raises(ValueError, match="num_blocks=0"):
        HSTU(SMALL.override(num_blocks=0))


def assert_computes_as_eager(model: HSTU, eager: HSTU, batches: tuple, device: str) -> list:
    """model gives eager's outputs and gradients (of the rows and every weight) on jagged
    batches of these lengths; returns model's gradients on the last batch."""
    for seed, lengths in enumerate(batches):
        emb, ts, offsets = (t.to(device) for t in sequence_batch(lengths, seed=seed))
        outputs, grads = [], []
        for m in (eager, model):
            x = emb.clone().requires_grad_(True)
            y = m(x, ts, offsets)
            outputs.append(y)
            weights = torch.linspace(-1, 1, y.numel(), device=device).view_as(y)
            grads.append(torch.autograd.grad((y * weights).sum(), [x, *m.parameters()]))
        torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-4)
        for got, want in zip(grads[1], grads[0]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    return grads[1]


def test_compiled_blocks_compute_what_the_eager_blocks_do():
    """compile_blocks: each block's work around the attention, the model's input and its
    output's normalization through torch.compile give the eager model's outputs and gradients (no dropout), over
    batches of several row counts, from one compilation of each function for every block and
    row count."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = SMALL.override(dropout=0.0, num_blocks=3)
    eager = HSTU(config).to(device)
    compiled = HSTU(config.override(compile_blocks=True)).to(device)
    compiled.load_state_dict(eager.state_dict())
    assert_computes_as_eager(compiled, eager, ([1, 3, 12, 5, 0, 7], [12, 2], [4, 4, 9, 1, 11, 6, 3]), device)
    # first_block_input, next_block_input and last_block_output, each traced once for all
    # blocks and batch sizes, and gated_norm where kernels.norm_mul_dropout does not run (on a
    # CPU the attention's twin runs, and with it torch's ops)
    graphs = 3 if device == "cuda" and config.norm_mul_dropout_kernel else 4
    assert counters["stats"]["unique_graphs"] == graphs
    assert counters["frames"]["ok"] == graphs


def test_the_model_compiled_whole_computes_what_the_eager_model_does():
    """compile_model: the whole forward as one graph, the Triton attention and
    kernels.norm_mul_dropout as custom ops in it (Triton's interpreter on a CPU), gives the
    eager model's outputs and gradients (the bias tables' too, no dropout: Inductor draws its
    own masks), over batches of several row counts, from one graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = SMALL.override(num_blocks=3, max_seq_len=70, dropout=0.0)
    eager = HSTU(config, attention_backend="triton").to(device)
    whole = HSTU(config.override(compile_model=True), attention_backend="triton").to(device)
    whole.load_state_dict(eager.state_dict())
    grads = assert_computes_as_eager(whole, eager, ([1, 3, 12, 5, 0, 7], [70, 2], [4, 4, 9, 1, 11, 6, 3]), device)
    assert all(g.abs().sum() > 0 for g in grads[-2:])  # (the last block's bias tables learn)
    assert counters["stats"]["unique_graphs"] == 1


def test_sampled_softmax_masks_accidental_hits():
    out = torch.nn.functional.normalize(torch.randn(3, 4), dim=-1)
    target = torch.randn(3, 4)
    target_ids = torch.tensor([1, 2, 3])
    negatives = torch.cat([target[:1], torch.randn(2, 4)])  # negative 0 is position 0's own target
    loss = sampled_softmax_loss(out, target, target_ids, negatives, torch.tensor([1, 8, 9]), 0.05)
    manual_logits = torch.cat([(out * torch.nn.functional.normalize(target, dim=-1)).sum(-1, keepdim=True),
                               out @ torch.nn.functional.normalize(negatives, dim=-1).T], 1) / 0.05
    manual_logits[0, 1] = float("-inf")
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(manual_logits, torch.zeros(3, dtype=torch.long)))


def test_the_compiled_sampled_softmax_computes_what_the_eager_one_does():
    """sampled_softmax_loss(compile=True): its per-position work through torch.compile gives
    the eager loss and gradients, over several row counts and padded rows, from one
    compilation."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(3)
    negatives, negative_ids = torch.randn(9, 8, generator=g), torch.arange(9)
    for rows, real in ((12, 12), (20, 17), (7, 5)):
        out = torch.nn.functional.normalize(torch.randn(rows, 8, generator=g), dim=-1)
        target, target_ids = torch.randn(rows, 8, generator=g), torch.randint(0, 12, (rows,), generator=g)
        losses, grads = [], []
        for compile in (False, True):
            leaves = [t.clone().requires_grad_(True) for t in (out, target, negatives)]
            loss = sampled_softmax_loss(*leaves[:2], target_ids, leaves[2], negative_ids, 0.05, real_rows=real, compile=compile)
            losses.append(loss)
            grads.append(torch.autograd.grad(loss, leaves))
        torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
        for got, want in zip(grads[1], grads[0]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


def test_the_catalog_softmax_is_the_sampled_softmax_over_every_item():
    out = torch.nn.functional.normalize(torch.randn(5, 4), dim=-1)
    catalog_emb = torch.randn(7, 4)
    target = torch.tensor([0, 3, 3, 6, 2])
    full = catalog_softmax_loss(out, catalog_emb, target, 0.05)
    sampled = sampled_softmax_loss(out, catalog_emb[target], target, catalog_emb, torch.arange(7), 0.05)
    torch.testing.assert_close(full, sampled)


def test_training_step_on_batches_with_and_without_targets():
    module = HSTULightningModule(SMALL, catalog=torch.arange(100, 130))
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    batches = [
        jagged_batch([]),  # an empty batch
        jagged_batch([(torch.tensor([101]).numpy(), torch.tensor([5]).numpy())]),  # one item: no target
        jagged_batch([(torch.arange(100, 108).numpy(), torch.arange(8).numpy()), (torch.tensor([120, 121]).numpy(), torch.tensor([1, 2]).numpy())]),
    ]
    weights = [p.detach().clone() for p in module.model.parameters()]
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    assert trainer.global_step == 3
    assert module.items.item_table.stats().size > 2  # items and negatives got rows
    assert any(not torch.equal(w, p) for w, p in zip(weights, module.model.parameters()))
    # the ranks' SIGTERM agreement without a wait per step (sigterm.py) is the loop's
    assert isinstance(trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor, DeferredSigtermBroadcast)


class RecordingLogger(Logger):
    """Every log_metrics call: (step, metrics)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    name, version = "recording", 0

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_the_loss_and_the_tables_statistics_reach_the_loggers_at_the_same_steps():
    """_log_step: every log_every_n_steps steps the loss (through Lightning) and samples/s
    and the tables' statistics (handed to the loggers) at the step Lightning logs the loss
    at, the statistics those of the table then."""
    module = HSTULightningModule(SMALL, catalog=torch.arange(100, 130))
    logger = RecordingLogger()
    sizes = []

    class TableSize(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            sizes.append(module.items.item_table.stats().size)

    trainer = L.Trainer(accelerator="cpu", max_steps=6, logger=logger, log_every_n_steps=2, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[TableSize()])
    batches = [jagged_batch([(np.arange(100 + 3 * i, 108 + 3 * i), np.arange(8))]) for i in range(6)]
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    steps = {name: [step for step, m in logger.calls if name in m] for name in ("train/loss", "emb/size", "train/samples_per_s")}
    assert steps["train/loss"] == steps["emb/size"] == [1, 3, 5]  # the 2nd, 4th and 6th steps
    assert steps["train/samples_per_s"] == [3, 5]  # (a rate needs a logged step before)
    logged_sizes = [m["emb/size"] for _, m in logger.calls if "emb/size" in m]
    assert logged_sizes == [float(sizes[1]), float(sizes[3]), float(sizes[5])] and logged_sizes[0] < logged_sizes[-1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a wait for the device needs a device")
def test_steps_after_a_logged_one_make_lightning_wait_for_nothing():
    """Lightning reads the progress bar's values (the logged loss) back at every step until
    the epoch ends: from the loss's host copy, so the steps after a logged one do not wait
    for the GPU there. Between steps (from the callbacks' batch end to the next batch's
    start, its pinned batch's copy included; not after the last step) Lightning makes no
    synchronizing call."""
    module = HSTULightningModule(SMALL, catalog=torch.arange(100, 130))

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step < trainer.max_steps:  # (not after the last: the fit's teardown moves results to the host)
                torch.cuda.set_sync_debug_mode("warn")

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            torch.cuda.set_sync_debug_mode("default")

    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=6, logger=False, log_every_n_steps=4, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Watch()])
    batches = [jagged_batch([(np.arange(100 + 3 * i, 108 + 3 * i), np.arange(8))]) for i in range(6)]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None, pin_memory=True))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert trainer.global_step == 6 and LOSS in trainer.callback_metrics  # logged at steps 0 and 4
    # (Lightning's own files: its package directory, not this project's lightning_modules)
    waits = [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message) and "/lightning/" in Path(w.filename).as_posix()]
    assert not waits, waits


def test_a_step_counted_without_stepping_advances_lightnings_global_step():
    """What a step graph's step does with the optimizer (count_optimizer_step): Lightning
    counts the step, and nothing touches the weights."""
    seen = []

    class Counted(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.weight = torch.nn.Parameter(torch.ones(3))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.5)

        def training_step(self, batch, batch_idx):
            seen.append(self.global_step)
            self.weight.grad = torch.ones(3)  # a step() would move the weight
            opt = self.optimizers()
            assert hasattr(opt, "_on_before_step") and hasattr(opt, "_on_after_step")  # (else the step itself is taken)
            count_optimizer_step(opt)
            self.weight.grad = None

    module = Counted()
    trainer = L.Trainer(accelerator="cpu", max_steps=3, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(torch.zeros(10, 1), batch_size=1))
    assert seen == [0, 1, 2] and trainer.global_step == 3  # (uncounted, the epoch would run all 10 batches)
    assert torch.equal(module.weight.detach(), torch.ones(3))


def test_a_checkpoint_saved_on_a_gpu_resumes_on_a_cpu(tmp_path):
    """A GPU run saves AdamW fused and capturable (step_graph.py), and a resumed run takes
    the checkpoint's optimizer settings: on a CPU it still steps, and trains on."""
    resumed_from = {}

    class Weights(L.Callback):
        def on_train_start(self, trainer, module):
            resumed_from.update({n: p.detach().clone() for n, p in module.model.named_parameters()})

    def fit(steps, ckpt_path=None):
        module = HSTULightningModule(SMALL, catalog=torch.arange(100, 130), checkpoint_dir=tmp_path)
        trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[Weights()])
        batches = [jagged_batch([(np.arange(100, 108), np.arange(8)), (np.array([120, 121, 125]), np.array([1, 2, 3]))])] * steps
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
        return trainer, module

    trainer, _ = fit(2)
    path = tmp_path / "gpu.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    for group in checkpoint["optimizer_states"][0]["param_groups"]:
        group.update(fused=True, capturable=True)  # as configure_optimizers makes them on a GPU
    torch.save(checkpoint, path)
    trainer, module = fit(3, ckpt_path=path)
    assert trainer.global_step == 3
    assert any(not torch.equal(resumed_from[n], p) for n, p in module.model.named_parameters())


def test_the_norm_mul_dropout_kernel_computes_the_blocks_outputs(monkeypatch):
    """norm_mul_dropout_kernel: where the attention runs its Triton kernels, each block's
    Dropout(LayerNorm(A V) ⊙ U) is kernels.norm_mul_dropout. Without dropout (eval) the
    outputs and gradients are torch's ops'; in training they are the twin's under the same
    seeds (the same masks), and differ from evaluation's. Its inputs come contiguous (U
    from block_input), so it copies neither."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    plain = HSTU(SMALL.override(norm_mul_dropout_kernel=False), attention_backend="triton").to(device)
    fused = HSTU(SMALL.override(norm_mul_dropout_kernel=True), attention_backend="triton").to(device)
    fused.load_state_dict(plain.state_dict())
    x, ts, offsets = (t.to(device) for t in sequence_batch([5, 3, 0, 7], SMALL.embedding_dim, seed=0))
    kernel, backends, contiguous = hstu.norm_mul_dropout, [], []

    def on(backend):
        def call(*args):
            backends.append(args[-1])
            contiguous.append(args[0].is_contiguous() and args[1].is_contiguous())
            return kernel(*args[:-1], backend)
        return call

    def step(model, seed):
        model.zero_grad()
        torch.manual_seed(seed)
        out = model(x, ts, offsets)
        out.square().sum().backward()
        return out, model.blocks[0].attn_norm.weight.grad, model.blocks[1].uvqk.weight.grad, model.blocks[0].output.weight.grad

    monkeypatch.setattr(hstu, "norm_mul_dropout", on("triton"))
    evaluated = [step(model.eval(), 0) for model in (fused, plain)]
    assert backends == ["triton"] * SMALL.num_blocks  # (the fused model's blocks only)
    assert all(contiguous)
    for got, want in zip(*evaluated):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    trained = []
    for backend in ("triton", "reference"):
        monkeypatch.setattr(hstu, "norm_mul_dropout", on(backend))
        trained.append(step(fused.train(), 3))
    for got, want in zip(*trained):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(trained[0][0], evaluated[0][0], atol=1e-3)


def test_the_layer_norm_kernel_computes_the_models_layer_norms():
    """layer_norm_kernel: the same weights (the same state keys) give the same outputs and
    gradients through the Triton kernels as through torch's layer norms."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    plain = HSTU(SMALL.override(layer_norm_kernel=False)).to(device).eval()
    kernel = HSTU(SMALL.override(layer_norm_kernel=True)).to(device).eval()
    kernel.load_state_dict(plain.state_dict())
    norms = [m for m in kernel.modules() if isinstance(m, KernelLayerNorm)]
    assert len(norms) == 2 * SMALL.num_blocks and not any(isinstance(m, KernelLayerNorm) for m in plain.modules())
    for m in norms:
        m.backend = "triton"  # (on a CPU, under Triton's interpreter)
    x, ts, offsets = (t.to(device) for t in sequence_batch([5, 3, 0, 7], SMALL.embedding_dim, seed=0))
    outputs = []
    for model in (kernel, plain):
        out = model(x, ts, offsets)
        out.square().sum().backward()
        outputs.append((out, model.blocks[0].input_norm.weight.grad, model.blocks[1].attn_norm.bias.grad))
    for got, want in zip(*outputs):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
