"""The model's training forward and backward from CUDA graphs: the padded loss is the real
rows' loss (CPU), and the graphs replay what the model computes (GPU). The padding itself:
test_row_padding.py."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from conftest import sequence_batch

from lightning_modules.config import HSTUConfig
from lightning_modules.cuda_graphs import GraphedHSTU
from lightning_modules.data_module import SequenceDataModule
from lightning_modules.datasets import prepare
from lightning_modules.hstu import HSTU
from lightning_modules.losses import catalog_softmax_loss, padded_catalog_softmax_loss
from lightning_modules.model_files import load_model
from lightning_modules.module import STEP_GRAPH_UNDER_DDP, HSTULightningModule

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIG = HSTUConfig(num_blocks=2, num_heads=2, attention_dim=8, linear_dim=8, embedding_dim=16, max_seq_len=12, dropout=0.0)
TWO_PROCESS_TRAINING_S = 300  # one 8-step run takes about 90 s on an H200, start-up and compilation included


def batch(lengths, seed, device="cpu"):
    return tuple(t.to(device) for t in sequence_batch(lengths, CONFIG.embedding_dim, seed))


@pytest.mark.parametrize("real", [13, 20, 1])
def test_the_padded_loss_is_the_real_rows_loss_with_their_gradients(real):
    """The full-catalog loss of a batch padded with rows of any value and any target, told
    how many rows are real, is the loss of the real rows: its value, and the gradients to
    the outputs (none to the padding rows) and to the items (the twin on a CPU, float64)."""
    gen = torch.Generator().manual_seed(real)
    rows, items, dim, temperature = 20, 30, 16, 0.05
    out = F.normalize(torch.randn(rows, dim, generator=gen, dtype=torch.float64), dim=-1)
    out[real:] = torch.randn(rows - real, dim, generator=gen, dtype=torch.float64) * 3  # padding: anything
    item_emb = torch.randn(items, dim, generator=gen, dtype=torch.float64)
    index = torch.randint(0, items, (rows,), generator=gen)
    results = []
    for padded in (False, True):
        o, e = out.clone().requires_grad_(True), item_emb.clone().requires_grad_(True)
        if padded:
            loss = padded_catalog_softmax_loss(o, e, index, temperature, torch.tensor(real))
        else:
            loss = catalog_softmax_loss(o[:real], e, index[:real], temperature)
        loss.backward()
        results.append((loss, o.grad, e.grad))
    (want, want_out, want_items), (got, got_out, got_items) = results
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_out, want_out)  # zeros past the real rows on both sides
    assert not got_out[real:].any()
    torch.testing.assert_close(got_items, want_items)


def test_the_loss_off_the_graphs_is_the_models_loss():
    """GraphedHSTU.catalog_loss where no graph serves (a CPU tensor, evaluation): the
    model's outputs and the catalog loss, as the module computes them without graphs."""
    torch.manual_seed(0)
    model = HSTU(CONFIG).double()
    graphed = GraphedHSTU(model, batch_slots=4, buckets=2)
    x, ts, offsets = batch([5, 12, 0, 3], seed=2)
    x = x.double().requires_grad_(True)
    items = torch.randn(9, CONFIG.embedding_dim, dtype=torch.float64)
    index = torch.randint(0, 9, (x.shape[0],))
    for training in (True, False):
        model.train(training)
        got = graphed.catalog_loss(x, ts, offsets, items, index, 0.05)
        torch.testing.assert_close(got, catalog_softmax_loss(model(x, ts, offsets), items, index, 0.05))
    assert not graphed.loss_graphs and not graphed.graphs


def test_buckets_cover_every_row_count_up_to_the_batch():
    graphed = GraphedHSTU(HSTU(CONFIG), batch_slots=4, buckets=3)  # 48 rows at most, buckets of 16
    assert [graphed.rows_for(r) for r in (0, 1, 16, 17, 32, 33, 48)] == [16, 16, 16, 32, 32, 48, 48]
    assert graphed.sizes == [16, 32, 48]
    assert GraphedHSTU(HSTU(CONFIG), batch_slots=5, buckets=7).sizes == [9, 18, 27, 36, 45, 54, 60]  # the last one cut to 60


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device")
def test_graph_replays_equal_the_model_in_each_bucket():
    """Training calls through the graphs, under bf16 autocast, against the model itself on
    the same batches: outputs, input and weight gradients, over batches that reuse a
    bucket's graph with new data and fall in several buckets."""
    torch.manual_seed(0)
    model = HSTU(CONFIG).to(DEVICE)
    graphed = GraphedHSTU(model, batch_slots=5, buckets=3)
    for seed, lengths in enumerate([[5, 12, 0, 3], [7, 1, 12, 10], [12, 12, 12, 9, 11], [2], []]):
        x, ts, offsets = batch(lengths, seed, DEVICE)
        weight = torch.randn(x.shape[0], CONFIG.embedding_dim, device=DEVICE)
        results = []
        for call in (graphed, model):
            xi = x.clone().requires_grad_(True)
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                out = call(xi, ts, offsets)
            (out.float() * weight).sum().backward()
            results.append((out.float(), xi.grad, {n: p.grad.clone() for n, p in model.named_parameters()}))
        (out_g, dx_g, grads_g), (out_m, dx_m, grads_m) = results
        torch.testing.assert_close(out_g, out_m, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(dx_g, dx_m, atol=2e-2, rtol=2e-2)
        for n in grads_m:
            torch.testing.assert_close(grads_g[n], grads_m[n], atol=5e-2, rtol=5e-2, msg=n)
    assert sorted(rows for rows, _ in graphed.graphs) == [20, 40, 60]  # every bucket, captured at the first call


class Losses(L.Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.values.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a CUDA device")
def test_training_through_the_graphs_follows_training_without_them(tmp_path):
    """The Lightning module on one GPU (bf16 autocast) with and without graphs, same seed
    and batches, no dropout: the graphs are used, and the step losses agree."""
    prepare("synthetic", tmp_path, synthetic_users=256, seed=0)
    curves = {}
    for buckets in (2, 0):
        L.seed_everything(0, verbose=False)
        config = HSTUConfig(num_blocks=2, num_heads=2, attention_dim=16, linear_dim=16, embedding_dim=32, max_seq_len=50,
                            dropout=0.0, batch_size=32, cuda_graph_buckets=buckets)
        data = SequenceDataModule(tmp_path, config.max_seq_len, config.batch_size)
        module = HSTULightningModule(config, data.catalog())
        losses = Losses()
        L.Trainer(accelerator="gpu", devices=1, max_steps=12, precision="bf16-mixed", logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, callbacks=[losses]).fit(module, datamodule=data)
        curves[buckets] = losses.values
        # the full softmax (the synthetic catalog is smaller than num_negatives) on one process:
        # the whole step's graphs
        assert bool(module.step_graph and module.step_graph.buckets) == bool(buckets)
    graphed, plain = torch.tensor(curves[2]), torch.tensor(curves[0])
    assert len(graphed) == 12 and plain[-1] < plain[0], (graphed.tolist(), plain.tolist())
    torch.testing.assert_close(graphed, plain, atol=0.05, rtol=0.02, msg=lambda m: f"{m}\ngraphed {graphed.tolist()}\nplain {plain.tolist()}")


def train_two_processes(data: Path, out: Path, buckets: int, *extra: str) -> tuple[dict[str, torch.Tensor], str]:
    """The training worker under torchrun, two processes (float32, no dropout, 8 steps),
    with `extra` arguments: the dense weights it saves, and its output."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=str(root))
    run = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "lightning_modules.train",
         "--data-dir", str(data), "--out-dir", str(out), "--max-steps", "8", "--batch-size", "64", "--max-seq-len", "50",
         "--dropout", "0", "--precision", "32-true", "--cuda-graph-buckets", str(buckets), "--val-users", "32",
         "--no-progress-bar", *extra],
        env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        output, _ = run.communicate(timeout=TWO_PROCESS_TRAINING_S)
    except subprocess.TimeoutExpired:  # (a process that never exits: the ranks too, not torchrun alone)
        os.killpg(run.pid, signal.SIGKILL)
        output, _ = run.communicate()
        pytest.fail(f"two-process training did not end within {TWO_PROCESS_TRAINING_S} s:\n{output[-3000:]}")
    assert run.returncode == 0, output[-6000:]
    model, _, _ = load_model(out / "model")
    return {n: t.detach() for n, t in model.state_dict().items()}, output


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP over two GPUs")
def test_ddp_training_through_the_graphs_follows_training_without_them(tmp_path):
    """Two processes on two GPUs under DDP, without graphs, with the model's graphs (DDP's
    all-reduce outside them) and with the step graphs (the all-reduce captured in them),
    same seed and batches: the weights trained agree, far closer than either is to where
    training started (a gradient all-reduce lost under the graphs would leave each rank on
    its own batches)."""
    prepare("synthetic", tmp_path / "data", synthetic_users=600, seed=0)
    plain, _ = train_two_processes(tmp_path / "data", tmp_path / "plain", 0)
    config = load_model(tmp_path / "plain" / "model")[0].config
    L.seed_everything(config.seed, verbose=False)
    start = HSTU(config).state_dict()
    travelled = torch.cat([(plain[n] - start[n]).flatten() for n in plain]).norm()
    for name, extra in (("graphed", ["--no-ddp-step-graph"]), ("step-graphed", ["--ddp-step-graph"])):
        graphed, output = train_two_processes(tmp_path / "data", tmp_path / name, 2, *extra)
        assert (STEP_GRAPH_UNDER_DDP in output) == (name == "step-graphed"), output[-3000:]
        apart = torch.cat([(graphed[n] - plain[n]).flatten() for n in plain]).norm()
        assert apart < 0.02 * travelled, (name, float(apart), float(travelled))
