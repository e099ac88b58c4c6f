"""The demo's training process: a small model, a CheckpointGuard, atomic checkpoints.

Run by ``esi-sidecar demo`` (``python -m sidecar.demo.trainer``), it is what a user's job
looks like: resume from the newest valid checkpoint, train, save when the guard says so,
stop after the final save. It reports each event as one JSON line on stdout so the demo
can draw its progress line and summary.

Training-side code, like the user's: standard library plus torch when it is installed
(a two-layer MLP on a synthetic regression task); without torch a pure-Python linear
model learns the same task. Steps are padded to ``--step-seconds`` to stand in for a GPU
step of known length.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional

from sidecar.checkpoint import atomic_checkpoint, capture_rng_state, latest_valid, restore_rng_state
from sidecar.guard import CheckpointGuard
from sidecar.policy import SavePolicy

FEATURES = 8


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "time": time.time(), **fields}), flush=True)


class TorchModel:
    """A two-layer MLP with Adam, learning y = sin(x . w) on random batches."""

    def __init__(self, seed: int) -> None:
        import torch

        self.torch = torch
        torch.manual_seed(seed)
        self.target = torch.randn(FEATURES) / FEATURES**0.5
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
        )
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=1e-2)

    def train_step(self) -> float:
        torch = self.torch
        x = torch.randn(256, FEATURES)
        y = torch.sin(x @ self.target).unsqueeze(1)
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss.item())

    def save(self, folder: Path, step: int) -> None:
        state = {
            "model": self.net.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "target": self.target,
            "step": step,
            "rng": capture_rng_state(),
        }
        self.torch.save(state, folder / "state.pt")

    def load(self, folder: Path) -> int:
        state = self.torch.load(folder / "state.pt", weights_only=True)
        self.net.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.target = state["target"]
        restore_rng_state(state["rng"])
        return int(state["step"])


class PlainModel:
    """The same task for a linear model in pure Python (when torch is not installed)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.target = [self.rng.gauss(0, 1) / FEATURES**0.5 for _ in range(FEATURES)]
        self.weights = [0.0] * FEATURES

    def train_step(self) -> float:
        total = 0.0
        gradient = [0.0] * FEATURES
        for _ in range(64):
            x = [self.rng.gauss(0, 1) for _ in range(FEATURES)]
            error = sum(w * v for w, v in zip(self.weights, x)) - math.sin(
                sum(t * v for t, v in zip(self.target, x)))
            total += error * error
            gradient = [g + 2 * error * v / 64 for g, v in zip(gradient, x)]
        self.weights = [w - 0.05 * g for w, g in zip(self.weights, gradient)]
        return total / 64

    def save(self, folder: Path, step: int) -> None:
        state = {"weights": self.weights, "target": self.target, "step": step,
                 "rng": list(self.rng.getstate()[1]), "rng_version": self.rng.getstate()[0]}
        (folder / "state.json").write_text(json.dumps(state))

    def load(self, folder: Path) -> int:
        state = json.loads((folder / "state.json").read_text())
        self.weights, self.target = state["weights"], state["target"]
        self.rng.setstate((state["rng_version"], tuple(state["rng"]), None))
        return int(state["step"])


def build_model(seed: int) -> Any:
    try:
        return TorchModel(seed)
    except ImportError:
        return PlainModel(seed)


def train(
    root: Path,
    total_steps: int,
    step_seconds: float,
    save_seconds: float,
    redundant_seconds: float,
    wait_after_stop: bool,
) -> int:
    model = build_model(seed=0)
    start = 0
    found = latest_valid(root)
    if found is not None:
        start = model.load(found.path) + 1
    emit("start", resumed_from=None if found is None else found.step, first_step=start,
         total_steps=total_steps, backend=type(model).__name__)
    guard = CheckpointGuard(
        policy=SavePolicy(save_seconds=save_seconds, redundant_seconds=redundant_seconds),
        refresh_seconds=0.5,
    )
    last_step: Optional[int] = None
    for step in range(start, total_steps):
        with guard.step():
            began = time.monotonic()
            loss = model.train_step()
            # Stand-in for a GPU step of a known length.
            time.sleep(max(0.0, step_seconds - (time.monotonic() - began)))
        last_step = step
        status = guard.status()
        emit("step", step=step, loss=loss, remaining=status.remaining_seconds)
        if guard.should_save():
            started = time.time()
            with guard.saving(), atomic_checkpoint(root, step, keep_last=3) as folder:
                model.save(folder, step)
            emit("save", step=step, seconds=time.time() - started,
                 remaining=guard.status().remaining_seconds)
        if guard.should_stop():
            emit("stop", step=step, remaining=guard.status().remaining_seconds)
            if wait_after_stop:
                # A real job would exit here; the demo keeps the process so the reclaim
                # can show that a kill -9 after the final save loses nothing.
                while True:
                    time.sleep(1)
            return 0
    if last_step is not None:
        with atomic_checkpoint(root, last_step, keep_last=3) as folder:
            model.save(folder, last_step)
        emit("save", step=last_step, seconds=0.0, remaining=None, final=True)
    emit("done", step=last_step)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--total-steps", type=int, required=True)
    parser.add_argument("--step-seconds", type=float, default=0.5)
    parser.add_argument("--save-seconds", type=float, default=3.0)
    parser.add_argument("--redundant-seconds", type=float, default=5.0)
    parser.add_argument("--wait-after-stop", action="store_true")
    args = parser.parse_args(argv)
    return train(args.root, args.total_steps, args.step_seconds, args.save_seconds,
                 args.redundant_seconds, args.wait_after_stop)


if __name__ == "__main__":
    sys.exit(main())
