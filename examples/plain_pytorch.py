"""A plain PyTorch training loop that saves before the machine is released.

    python examples/plain_pytorch.py --steps 50
    python examples/plain_pytorch.py --steps 50 --release-in 30   # pretend: released soon
    python examples/plain_pytorch.py --steps 100000000 --sigterm-grace 25 --save-seconds 1

The daemon (``esi-sidecar serve``) tells the guard when this machine goes away; without
one, the guard falls back to the platform's capacity-block variables. ``--release-in``
sets such a variable for this process only, so the save path can be watched on a laptop.
The model is the demo's toy (a small torch MLP, or pure Python without torch); the loop
is the same for yours.

The part to copy is ``train``: ten lines around your own step and save functions, with
``atomic_checkpoint`` (a kill mid-save leaves the previous checkpoint intact) and
``latest_valid`` (resume from the newest complete one). After the final save the guard
waits in ``should_stop()`` for the release (a renewal resumes training); when it comes,
the script exits with ``EXIT_RELEASED`` (75) so a launcher tells it from a crash.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from sidecar import EXIT_RELEASED, CheckpointGuard, SavePolicy, atomic_checkpoint, latest_valid
from sidecar.tools.demo.toy_model import build_model
from sidecar.train.deadline import ENV_DEADLINE_VARIABLES
from sidecar.train.policy import DEFAULT_TOP_UP_SECONDS


def train(model: Any, guard: CheckpointGuard, root: Path, steps: int) -> int:
    """The loop to copy. Returns the next step to run."""
    found = latest_valid(root)  # None on the first run
    step = model.load(found.path) + 1 if found is not None else 0
    logging.info("training steps %d to %d", step, steps - 1)
    while step < steps:
        with guard.step():  # times the step: the policy's T_max_step
            model.train_step()
        if guard.should_save():  # the final save near the deadline, then maybe a top-up
            with guard.saving(step), atomic_checkpoint(root, step) as folder:  # times T_save
                model.save(folder, step)
        if guard.should_stop():  # saved, then waited: the release has come
            logging.info("stopping at step %d: %s", step, guard.status().reason)
            return step + 1
        step += 1
    return step


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--checkpoints", type=Path, default=None,
                        help="checkpoint folder (default: a temporary one)")
    parser.add_argument(
        "--release-in",
        type=float,
        default=None,
        help="pretend the machine is released in this many seconds (sets "
        f"{ENV_DEADLINE_VARIABLES[0]} for this process)",
    )
    parser.add_argument("--save-seconds", type=float, default=None,
                        help="assumed save time until one is measured (default: the policy's)")
    parser.add_argument("--sigterm-grace", type=float, default=None, metavar="SECONDS",
                        help="take SIGTERM as the release this many seconds later (set it "
                        "below the platform's grace period; default: SIGTERM ends the job)")
    parser.add_argument("--top-up-seconds", default=DEFAULT_TOP_UP_SECONDS,
                        type=lambda text: None if text == "off" else float(text),
                        help="margin of the top-up save after the final one ('off': none; "
                        f"default {DEFAULT_TOP_UP_SECONDS:g})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    environ = dict(os.environ)
    if args.release_in is not None:
        environ[ENV_DEADLINE_VARIABLES[0]] = str(time.time() + args.release_in)
    policy = SavePolicy(top_up_seconds=args.top_up_seconds)
    if args.save_seconds is not None:
        policy = SavePolicy(args.save_seconds, top_up_seconds=args.top_up_seconds)
    guard = CheckpointGuard(policy=policy, environ=environ,
                            sigterm_grace_seconds=args.sigterm_grace)
    model = build_model(seed=0)
    with tempfile.TemporaryDirectory() as scratch:
        root = args.checkpoints or Path(scratch)
        next_step = train(model, guard, root, args.steps)
        found = latest_valid(root)
        status = guard.status()
        print(
            f"model={type(model).__name__} ran to step {next_step}/{args.steps}; "
            f"checkpoint {found.path if found else 'not written'}; "
            f"deadline from {status.deadline_source or 'nowhere'}; {status.reason}"
        )
    if guard.released:
        raise SystemExit(EXIT_RELEASED)


if __name__ == "__main__":
    main()
