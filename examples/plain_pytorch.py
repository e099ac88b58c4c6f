"""A plain PyTorch training loop that saves before the machine is released.

    python examples/plain_pytorch.py --steps 50
    python examples/plain_pytorch.py --steps 50 --release-in 170   # pretend: released soon

The daemon (``esi-sidecar serve``) tells the guard when this machine goes away; without
one, the guard falls back to the platform's capacity-block variables. ``--release-in``
sets such a variable for this process only, so the save path can be watched on a laptop.
torch is optional here: without it a pure-Python toy model stands in, the loop is the same.

The part to copy is ``train``: ten lines around your own step and save functions.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from sidecar import CheckpointGuard, SavePolicy
from sidecar.client import ENV_DEADLINE_VARIABLES

try:
    import torch

    HAVE_TORCH = True
except ImportError:  # the example still runs, with a toy model
    HAVE_TORCH = False


class TorchModel:
    """A tiny regression model with the usual model / optimizer / state_dict shape."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.target = torch.randn(8, 1)

    def train_step(self) -> float:
        inputs = torch.randn(32, 8)
        loss = torch.nn.functional.mse_loss(self.model(inputs), inputs @ self.target)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def save(self, path: Path, step: int) -> None:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        _atomic_write(path, lambda f: torch.save({**state, "step": step}, f))

    def load(self, path: Path) -> int:
        state = torch.load(path, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        return int(state["step"])


class ToyModel:
    """The same interface in pure Python: y = w . x fitted by gradient descent."""

    def __init__(self) -> None:
        self.rng = random.Random(0)
        self.target = [self.rng.gauss(0, 1) for _ in range(8)]
        self.weights = [0.0] * 8

    def train_step(self) -> float:
        x = [self.rng.gauss(0, 1) for _ in range(8)]
        error = sum(w * xi for w, xi in zip(self.weights, x)) - sum(
            t * xi for t, xi in zip(self.target, x)
        )
        self.weights = [w - 0.05 * 2 * error * xi for w, xi in zip(self.weights, x)]
        return error * error

    def save(self, path: Path, step: int) -> None:
        body = json.dumps({"weights": self.weights, "step": step}).encode()
        _atomic_write(path, lambda f: f.write(body))

    def load(self, path: Path) -> int:
        state = json.loads(path.read_text())
        self.weights = state["weights"]
        return int(state["step"])


def _atomic_write(path: Path, write: Any) -> None:
    """Temp file in the same folder, fsync, rename: a crash never leaves half a checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(descriptor, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def train(model: Any, guard: CheckpointGuard, checkpoint: Path, steps: int) -> int:
    """The loop to copy. Returns the next step to run."""
    step = model.load(checkpoint) + 1 if checkpoint.exists() else 0
    while step < steps:
        with guard.step():  # times the step: the policy's T_max_step
            model.train_step()
        if guard.should_save():  # once, when the deadline is near
            with guard.saving():  # times the save: the policy's T_save
                model.save(checkpoint, step)
        if guard.should_stop():  # saved; another step could not be saved in time
            logging.info("stopping at step %d: %s", step, guard.status().reason)
            return step + 1
        step += 1
    return step


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: a temp dir")
    parser.add_argument(
        "--release-in",
        type=float,
        default=None,
        help="pretend the machine is released in this many seconds (sets "
        f"{ENV_DEADLINE_VARIABLES[0]} for this process)",
    )
    parser.add_argument("--save-seconds", type=float, default=60.0, help="assumed save time")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    environ = dict(os.environ)
    if args.release_in is not None:
        environ[ENV_DEADLINE_VARIABLES[0]] = str(time.time() + args.release_in)
    guard = CheckpointGuard(policy=SavePolicy(save_seconds=args.save_seconds), environ=environ)
    model = TorchModel() if HAVE_TORCH else ToyModel()
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = args.checkpoint or Path(scratch) / "checkpoint.pt"
        next_step = train(model, guard, checkpoint, args.steps)
        status = guard.status()
        print(
            f"model={type(model).__name__} ran to step {next_step}/{args.steps}; "
            f"checkpoint {checkpoint if checkpoint.exists() else 'not written'}; "
            f"deadline from {status.deadline_source or 'nowhere'}; {status.reason}"
        )


if __name__ == "__main__":
    main()
