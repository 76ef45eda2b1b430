"""The ranks' SIGTERM agreement (lightning_modules/sigterm.py) on two gloo processes: in
place of Lightning's per-step broadcast inside a real training loop, and rank 0's flag
stopping both ranks at the same step, one after Lightning's own broadcast would."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = r'''
import json, os, sys
from types import SimpleNamespace

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_modules.sigterm import DeferredSigtermBroadcast, defer_sigterm_broadcast


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def on_train_start(self):
        self.installed = defer_sigterm_broadcast(self.trainer)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


module = Tiny()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=4, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(module, torch.utils.data.DataLoader(torch.randn(64, 2), batch_size=4))
check = trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor
in_loop = module.installed and isinstance(check, DeferredSigtermBroadcast) and check.pending  # the loop called it

# rank 0 is signalled during step 2: its flag travels with step 3's broadcast, read at step 4
rank = dist.get_rank()
fake = SimpleNamespace(received_sigterm=False, strategy=SimpleNamespace(root_device=torch.device("cpu")))
deferred, stopped = DeferredSigtermBroadcast(fake), None
for step in range(8):
    try:
        deferred()
    except SIGTERMException:
        stopped = step
        break
    if step == 2 and rank == 0:
        fake.received_sigterm = True
with open(sys.argv[1] + f".{rank}", "w") as f:
    json.dump({"in_loop": bool(in_loop), "stopped": stopped}, f)
'''


def test_both_ranks_stop_at_the_step_after_rank_0s_flag_is_broadcast(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    out = tmp_path / "result"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert results == [{"in_loop": True, "stopped": 4}] * 2
