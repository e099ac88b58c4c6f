"""A plain PyTorch training loop that saves before the machine is released.

    python examples/plain_pytorch.py --steps 100000000 --release-in 10 \\
        --save-seconds 1 --redundant-seconds 4     # trains 5 s, saves, exits 75 (~15 s)
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
from pathlib import Path
from typing import Any, Optional

from example_support import add_options, exit_status, follow, policy, resume_line

from sidecar import CheckpointGuard, atomic_checkpoint, latest_valid
from sidecar.tools.demo.toy_model import build_model


def train(model: Any, guard: CheckpointGuard, root: Path, steps: int) -> int:
    """The loop to copy. Returns the next step to run."""
    found = latest_valid(root)  # None on the first run
    print(f"start: resuming from step {found.step} ({found.path})" if found is not None
          else "start: from scratch", flush=True)
    step = model.load(found.path) + 1 if found is not None else 0
    logging.info("training steps %d to %d", step, steps - 1)
    while step < steps:
        with guard.step():  # times the loop's pass (since the last step): T_max_step
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
    add_options(parser, "plain_pytorch", steps=50)
    parser.add_argument("--checkpoints", type=Path, dest="output", help=argparse.SUPPRESS)
    parser.add_argument("--sigterm-grace", type=float, default=None, metavar="SECONDS",
                        help="take SIGTERM as the release this many seconds later (set it "
                        "below the platform's grace period; default: SIGTERM ends the job)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    model = build_model(seed=0)  # imports torch, if there, before --release-in counts
    environ = dict(os.environ)  # --release-in: this guard's environment only
    client, line = follow(args.release_in, environ)
    print(line, flush=True)
    guard = CheckpointGuard(client, policy=policy(args), environ=environ,
                            sigterm_grace_seconds=args.sigterm_grace,
                            events=args.release_in is None)
    next_step = train(model, guard, args.output, args.steps)
    found = latest_valid(args.output)
    status = guard.status()
    print(
        f"model={type(model).__name__} ran to step {next_step}/{args.steps}; "
        f"checkpoint {found.path.resolve() if found else 'not written'}; "
        f"deadline from {status.deadline_source or 'nowhere'}; {status.reason}"
    )
    if found is not None and next_step < args.steps:
        print(resume_line(args.output, found.step))
    raise SystemExit(exit_status(guard.released))


if __name__ == "__main__":
    main()
