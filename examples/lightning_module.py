"""A Lightning module that saves before the machine is released, then stops.

    python examples/lightning_module.py --steps 100000 --release-in 10 \\
        --save-seconds 1 --redundant-seconds 4     # trains a few s, saves, exits 75 (~25 s)
    python examples/lightning_module.py --output checkpoints/lightning_module --steps N
                                 # the "resume:" line it printed: resumes, 50 steps, done

The callback asks the daemon ($ESI_SIDECAR_URL, default http://127.0.0.1:8791) after every
optimizer step; without a daemon it falls back to the platform's capacity-block variable,
which ``--release-in`` sets for this process only (the daemon is then not asked: that
deadline wins; the first line printed says which one is followed). When the deadline is
near it calls ``trainer.save_checkpoint`` once (``esi-epoch=E-step=S.ckpt``, renamed into
place once complete), waits for the release and stops the Trainer; the script then exits
with ``EXIT_RELEASED`` (75). The next start passes the newest such file as ``ckpt_path``.
A tiny regression model on random data, on the CPU."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from example_support import add_options, exit_status, follow, policy, resume_line

from sidecar.integrations.lightning import (
    EsiCheckpointCallback,
    checkpoint_step,
    latest_checkpoint,
)


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
    add_options(parser, "lightning_module", steps=300)
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("sidecar").setLevel(logging.INFO)  # "checkpoint now: ..." and why
    client, line = follow(args.release_in)
    print(line, flush=True)

    checkpoints: Path = args.output
    # The callback builds its guard inside trainer.fit(), once the strategy has set up
    # torch.distributed: with devices > 1 it then has the reducer that makes every rank
    # save at the same step. (A guard built here, before fit, could not have it.)
    esi = EsiCheckpointCallback(dirpath=checkpoints, policy=policy(args), client=client,
                                events=args.release_in is None)
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
    step = trainer.global_step
    saved = latest_checkpoint(checkpoints)  # the newest: the top-up save when there was one
    saved_step = None if saved is None else checkpoint_step(saved)
    if esi.saves and saved:
        print(f"saved: checkpoint at step {saved_step} -> {saved.resolve()}")
    if esi.stopped:
        print(f"stop: step {step}")  # the guard logged why
    # Otherwise the run is complete: save your final model here as usual.
    print(f"done: trained {step}/{args.steps} steps; deadline from "
          f"{status.deadline_source or 'nowhere'}")
    if esi.stopped and saved_step is not None:
        print(resume_line(args.output, saved_step))
    raise SystemExit(exit_status(esi.guard.released))


if __name__ == "__main__":
    main()
