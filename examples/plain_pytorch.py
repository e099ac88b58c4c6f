"""A plain PyTorch training loop that saves before the machine is released.

    python examples/plain_pytorch.py --steps 100000000 --release-in 15 \\
        --save-seconds 1 --redundant-seconds 4     # trains a few s, saves, exits 75 (~20 s)
    python examples/plain_pytorch.py --output checkpoints/plain_pytorch --steps N
                                 # the "resume:" line it printed: resumes, 50 steps, done
    python examples/plain_pytorch.py --steps 100000000 --sigterm-grace 25 --save-seconds 1

The daemon (``esi-sidecar serve``) tells the guard when this machine goes away; without
one, the guard falls back to the platform's capacity-block variables. ``--release-in``
sets such a variable for this process only and the daemon is then not asked, so the save
path can be watched on a laptop whether a daemon runs or not. The first line it prints
says which deadline it follows.
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
import sys
import time
from pathlib import Path
from typing import Any, Optional

from sidecar import EXIT_RELEASED, CheckpointGuard, SavePolicy, atomic_checkpoint, latest_valid
from sidecar.tools.demo.toy_model import build_model
from sidecar.train.client import SidecarClient
from sidecar.train.deadline import ENV_DEADLINE_VARIABLES
from sidecar.train.policy import DEFAULT_TOP_UP_SECONDS

DEFAULT_OUTPUT = Path("checkpoints") / "plain_pytorch"  # under the working folder: it stays


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


class ReleaseInOnly(SidecarClient):
    """A client that never asks a daemon: with ``--release-in`` that deadline wins."""

    def expiry(self) -> None:
        self.last_error = "not asked: --release-in sets the deadline"
        return None


def follows(release_in: Optional[float], client: SidecarClient) -> str:
    """The line that says which deadline this run follows."""
    if release_in is not None:
        at = time.strftime("%H:%M:%S", time.localtime(time.time() + release_in))
        return f"deadline: --release-in {release_in:g} s (at {at}); no daemon is asked"
    return (f"deadline: the daemon's at {', '.join(client.urls)} "
            f"(without one: {' or '.join(ENV_DEADLINE_VARIABLES)})")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT,
                        help="checkpoint folder; a rerun resumes from its newest "
                        f"(default: ./{DEFAULT_OUTPUT})")
    parser.add_argument("--checkpoints", type=Path, dest="output", help=argparse.SUPPRESS)
    parser.add_argument(
        "--release-in",
        type=float,
        default=None,
        help="pretend the machine is released in this many seconds (sets "
        f"{ENV_DEADLINE_VARIABLES[0]} for this process); it wins over a running "
        "daemon, which is then not asked",
    )
    parser.add_argument("--save-seconds", type=float, default=None,
                        help="assumed save time until one is measured (default: the policy's)")
    parser.add_argument("--redundant-seconds", type=float, default=None,
                        help="safety margin (default: the policy's)")
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
    client = SidecarClient()
    if args.release_in is not None:
        environ[ENV_DEADLINE_VARIABLES[0]] = str(time.time() + args.release_in)
        client = ReleaseInOnly()
    print(follows(args.release_in, client), flush=True)
    rule = {name: value for name, value in (("save_seconds", args.save_seconds),
                                            ("redundant_seconds", args.redundant_seconds))
            if value is not None}
    policy = SavePolicy(**rule, top_up_seconds=args.top_up_seconds)
    guard = CheckpointGuard(client, policy=policy, environ=environ,
                            sigterm_grace_seconds=args.sigterm_grace,
                            events=args.release_in is None)
    model = build_model(seed=0)
    next_step = train(model, guard, args.output, args.steps)
    found = latest_valid(args.output)
    status = guard.status()
    print(
        f"model={type(model).__name__} ran to step {next_step}/{args.steps}; "
        f"checkpoint {found.path.resolve() if found else 'not written'}; "
        f"deadline from {status.deadline_source or 'nowhere'}; {status.reason}"
    )
    if found is not None and next_step < args.steps:
        # A few steps past the checkpoint, so the resumed run ends soon on any machine.
        print(f"resume: python {sys.argv[0]} --output {args.output} --steps {found.step + 50}")
    if guard.released:
        raise SystemExit(EXIT_RELEASED)


if __name__ == "__main__":
    main()
