"""One Lightning run on 2 CPU ranks, with torch's DDP or MiniDDP; rank 0 saves what happened step by step.

    python tests/library/frameworks/lightning_run.py {torch|minddp} {ddp|ddp_spawn} {auto|manual} OUT_DIR [PACKAGE]

``auto``: fit with validation, ``accumulate_grad_batches=2``, ``ModelCheckpoint``, then (``ddp``) a
second Trainer resuming from the last checkpoint for one more epoch. ``manual``: manual
optimization, one step in three taking no backward. Rank 0 saves each fit to ``OUT_DIR/fitN.pt``:
per training step the loss, the parameters and the buffers; the validation losses; the final state.
(Lightning's ``ddp`` runs this file again for rank 1; ``ddp_spawn`` runs the fit in spawned processes.)
``PACKAGE``: ``pytorch_lightning`` (the default) or the unified ``lightning.pytorch``, the one this
script imports, as a user's script imports one of them.
"""

import sys

import importlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(1)
PACKAGE = sys.argv[5] if len(sys.argv) > 5 else "pytorch_lightning"
pl = importlib.import_module(PACKAGE)
ModelCheckpoint = importlib.import_module(f"{PACKAGE}.callbacks").ModelCheckpoint


class Net(pl.LightningModule):
    def __init__(self, manual: bool, save_to: str):
        super().__init__()
        self.save_to = save_to
        self.automatic_optimization = not manual
        self.net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
        self.record = {"steps": [], "val": []}

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        if not self.automatic_optimization:
            if batch_idx % 3 != 2:  # one step in three: no backward (torch then skips the next buffer sync)
                optimizer = self.optimizers()
                optimizer.zero_grad()
                self.manual_backward(loss)
                optimizer.step()
        self.record["steps"].append(self._snapshot(loss))
        return loss if self.automatic_optimization else None

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.record["val"].append(loss.detach().clone())
        self.log("val_loss", loss, sync_dist=True)

    def _snapshot(self, loss):
        return {"loss": loss.detach().clone(),
                "state": {name: t.detach().clone() for name, t in self.net.state_dict().items()}}

    def on_fit_end(self):
        if self.global_rank == 0:  # in the process that trained (ddp_spawn's parent did not)
            final = {name: t.detach().clone() for name, t in self.net.state_dict().items()}
            torch.save({**self.record, "final": final}, self.save_to)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loaders():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 6, generator=g), torch.randn(48, 2, generator=g)
    train = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=4)
    val = DataLoader(TensorDataset(x[32:], y[32:]), batch_size=4)
    return train, val


def strategy(which: str, launch: str):
    start_method = "spawn" if launch == "ddp_spawn" else "popen"
    if which == "minddp":
        from minddp.frameworks.lightning import MiniDDPStrategy

        return MiniDDPStrategy(start_method=start_method)
    return launch


def trainer(which, launch, out, epochs, manual, **kwargs):
    extra = {} if manual else {"accumulate_grad_batches": 2}
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy(which, launch), max_epochs=epochs,
                      default_root_dir=out, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, deterministic=True, **extra, **kwargs)


def main(which, launch, mode, out):
    """The fit (and for ``auto`` with ``ddp``, a second Trainer resuming from its last checkpoint)."""
    manual = mode == "manual"
    pl.seed_everything(0, workers=True)
    first = trainer(which, launch, out, 2, manual, callbacks=[ModelCheckpoint(dirpath=out, save_last=True)])
    first.fit(Net(manual, f"{out}/fit1.pt"), *loaders())
    if not manual and launch == "ddp":
        pl.seed_everything(0, workers=True)
        second = trainer(which, launch, out, 3, manual)
        second.fit(Net(manual, f"{out}/fit2.pt"), *loaders(), ckpt_path=f"{out}/last.ckpt")


if __name__ == "__main__":
    main(*sys.argv[1:5])  # (PACKAGE read above)
