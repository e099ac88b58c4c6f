"""The toy model behind the demo and ``examples/plain_pytorch.py``: one trainer for both.

Training-side code, like a user's: standard library plus torch when it is installed (a
two-layer MLP on a synthetic regression task); without torch a pure-Python linear model
learns the same task. ``save(folder, step)`` writes into a checkpoint folder (the one
``atomic_checkpoint`` hands out) and ``load(folder)`` returns the step it holds.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

from sidecar.checkpoint.rng import capture_rng_state, restore_rng_state

__all__ = ["PlainModel", "TorchModel", "build_model"]

FEATURES = 8


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
