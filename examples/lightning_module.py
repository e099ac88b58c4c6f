"""A Lightning module that saves before the machine is released, then stops.

    python examples/lightning_module.py --steps 100000 --release-in 190   # trains ~10 s, saves
    python examples/lightning_module.py --steps 300                       # resumes from it

The callback asks the daemon ($ESI_SIDECAR_URL, default http://127.0.0.1:8791) after every
optimizer step; without a daemon it falls back to the platform's capacity-block variable,
which ``--release-in`` sets for this process only. When the deadline is near it calls
``trainer.save_checkpoint`` once (``esi-epoch=E-step=S.ckpt``, renamed into place once
complete) and stops the Trainer; the next start passes the newest such file as
``ckpt_path``. A tiny regression model on random data, on the CPU.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch

from sidecar import SavePolicy
from sidecar.integrations.lightning import (
    EsiCheckpointCallback,
    checkpoint_step,
    latest_checkpoint,
)
from sidecar.train.deadline import ENV_DEADLINE_VARIABLES
from sidecar.train.policy import DEFAULT_TOP_UP_SECONDS


class TinyRegression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def random_data() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 8, generator=generator)
    targets = torch.sin(inputs.sum(dim=1, keepdim=True))
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(inputs, targets), batch_size=16
    )


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps in all")
    parser.add_argument(
        "--output",
        type=Path,
        default=Path(tempfile.gettempdir()) / "esi-examples" / "lightning_module",
        help="checkpoints go to OUTPUT/checkpoints; a rerun resumes from the newest",
    )
    parser.add_argument(
        "--release-in",
        type=float,
        default=None,
        help="pretend the machine is released in this many seconds (sets "
        f"{ENV_DEADLINE_VARIABLES[0]} for this process)",
    )
    parser.add_argument("--save-seconds", type=float, default=60.0, help="assumed save time")
    parser.add_argument("--redundant-seconds", type=float, default=120.0, help="safety margin")
    parser.add_argument("--top-up-seconds", default=DEFAULT_TOP_UP_SECONDS,
                        type=lambda text: None if text == "off" else float(text),
                        help="margin of the top-up save after the final one ('off': none; "
                        f"default {DEFAULT_TOP_UP_SECONDS:g})")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("sidecar").setLevel(logging.INFO)  # "checkpoint now: ..." and why
    if args.release_in is not None:
        os.environ[ENV_DEADLINE_VARIABLES[0]] = str(time.time() + args.release_in)

    checkpoints = args.output / "checkpoints"
    # The callback builds its guard inside trainer.fit(), once the strategy has set up
    # torch.distributed: with devices > 1 it then has the reducer that makes every rank
    # save at the same step. (A guard built here, before fit, could not have it.)
    esi = EsiCheckpointCallback(
        dirpath=checkpoints,
        policy=SavePolicy(save_seconds=args.save_seconds, redundant_seconds=args.redundant_seconds,
                   top_up_seconds=args.top_up_seconds),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        callbacks=[esi],
        enable_checkpointing=False,  # the ESI save is the only one here; any setup works
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(args.output),
    )

    # The newest complete save (a save cut short keeps a temporary name and is skipped).
    ckpt_path = latest_checkpoint(checkpoints)
    if ckpt_path:  # Lightning's full state: weights, optimizer, loop position
        print(f"start: resuming from step {checkpoint_step(ckpt_path)} ({ckpt_path})",
              flush=True)
    else:
        print("start: from scratch", flush=True)
    trainer.fit(TinyRegression(), train_dataloaders=random_data(), ckpt_path=ckpt_path)

    status = esi.guard.status()  # built by the callback at the start of training
    if esi.saves:
        print(f"saved: checkpoint at step {trainer.global_step} -> {esi.last_checkpoint_path}")
    if esi.stopped:
        print(f"stop: step {trainer.global_step}")  # the guard logged why
    # Otherwise the run is complete: save your final model here as usual.
    print(f"done: trained {trainer.global_step}/{args.steps} steps; deadline from "
          f"{status.deadline_source or 'nowhere'}")


if __name__ == "__main__":
    main()
