"""What the examples share and yours does not need: their flags, ``--release-in``, the
lines they print at the end, and ``--nproc-per-node`` for the distributed ones.

The ESI part of each example is in the example itself; this module only stands in for a
real deadline (``--release-in``: the platform's capacity-block variable, for this run
only, and no daemon asked) and keeps the flags and the printed lines alike in all of them.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import multiprocessing
import os
import shlex
import socket
import sys
import time
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from typing import Callable, Optional

from sidecar import EXIT_RELEASED, SavePolicy
from sidecar.checkpoint.folders import latest_valid
from sidecar.train.client import SidecarClient
from sidecar.train.deadline import ENV_DEADLINE_VARIABLES
from sidecar.train.policy import DEFAULT_TOP_UP_SECONDS

# Set by launch() for its ranks: the launcher prints the last lines (a rank under
# torchrun, or alone, prints them itself).
ENV_LAUNCHED = "ESI_EXAMPLE_LAUNCHED"
MORE_STEPS = 50  # the resume line trains this many past the checkpoint: it ends soon


def add_options(parser: argparse.ArgumentParser, example: str, *, steps: int,
                ranks: bool = False) -> None:
    """The flags every example has, with the same names, defaults and help; ``ranks``:
    ``--nproc-per-node`` too."""
    output = Path("checkpoints") / example  # under the working folder: it stays
    parser.add_argument("--steps", type=int, default=steps, help="training steps in all")
    parser.add_argument("--output", type=Path, default=output,
                        help=f"checkpoint folder; a rerun resumes from its newest "
                        f"(default: ./{output})")
    parser.add_argument(
        "--release-in", type=float, default=None, metavar="SECONDS",
        help="pretend the machine is released in this many seconds (sets "
        f"{ENV_DEADLINE_VARIABLES[0]} for this run); it wins over a running daemon, "
        "which is then not asked",
    )
    parser.add_argument("--save-seconds", type=float, default=None,
                        help="assumed save time until one is measured (default: the "
                        "policy's, 60)")
    parser.add_argument("--redundant-seconds", type=float, default=None,
                        help="safety margin (default: the policy's, 120)")
    parser.add_argument("--top-up-seconds", default=DEFAULT_TOP_UP_SECONDS,
                        type=lambda text: None if text == "off" else float(text),
                        help="margin of the top-up save after the final one ('off': none; "
                        f"default {DEFAULT_TOP_UP_SECONDS:g})")
    if ranks:
        parser.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                            help="start N ranks on this machine (gloo on loopback), as "
                            "torchrun does; under torchrun leave it out")


def policy(args: argparse.Namespace) -> SavePolicy:
    rule = {name: value for name, value in (("save_seconds", args.save_seconds),
                                            ("redundant_seconds", args.redundant_seconds))
            if value is not None}
    return SavePolicy(**rule, top_up_seconds=args.top_up_seconds)


class ReleaseInOnly(SidecarClient):
    """A client that never asks a daemon: with ``--release-in`` that deadline wins."""

    def expiry(self) -> None:
        self.last_error = "not asked: --release-in sets the deadline"
        return None


def follow(release_in: Optional[float],
           environ: MutableMapping[str, str] = os.environ) -> tuple[SidecarClient, str]:
    """The client to build the guard with, and the line that says which deadline the run
    follows. ``--release-in`` writes the fallback variable into ``environ``; call it after
    ``init_process_group``, so that every rank takes rank 0's deadline."""
    if release_in is None:
        client = SidecarClient()
        return client, (f"deadline: the daemon's at {', '.join(client.urls)} "
                        f"(without one: {' or '.join(ENV_DEADLINE_VARIABLES)})")
    at = rank_zeros(time.time() + release_in)
    environ[ENV_DEADLINE_VARIABLES[0]] = repr(at)
    clock = time.strftime("%H:%M:%S", time.localtime(at))
    return ReleaseInOnly(), (f"deadline: --release-in {release_in:g} s (at {clock}); "
                             "no daemon is asked")


def rank_zeros(value: float) -> float:
    """Rank 0's ``value`` on every rank once torch.distributed is set up, else ``value``
    (torch is not imported for it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return float(shared[0])


def launched() -> bool:
    """A rank started by :func:`launch` (which then prints the last lines)."""
    return ENV_LAUNCHED in os.environ


def resume_line(output: Path, step: int, command: Optional[Sequence[str]] = None) -> str:
    """The line that resumes from the checkpoint of ``step`` and ends soon."""
    words = list(command) if command is not None else ["python", sys.argv[0]]
    return f"resume: {shlex.join(words)} --output {output} --steps {step + MORE_STEPS}"


def exit_status(released: bool) -> int:
    return EXIT_RELEASED if released else 0


def finished(args: argparse.Namespace, *, stopped: bool, torchrun: bool = False) -> None:
    """The newest checkpoint and, when the run stopped before the end, the line that
    resumes from it, started the way this run was."""
    found = latest_valid(args.output)
    print(f"checkpoint {found.path.resolve() if found else 'not written'}")
    if found is None or not stopped:
        return
    if torchrun:
        command = ["torchrun", "--nproc-per-node", os.environ.get("WORLD_SIZE", "1"),
                   sys.argv[0]]
    else:
        command = ["python", sys.argv[0]]
        if args.nproc_per_node > 1:
            command += ["--nproc-per-node", str(args.nproc_per_node)]
    print(resume_line(args.output, found.step, command))


def ranks_main(parse: Callable[[list[str]], argparse.Namespace],
               rank_main: Callable[[list[str]], int]) -> int:
    """A distributed example's ``main``: one rank (under torchrun, or alone), or
    ``--nproc-per-node`` ranks started here; the exit status."""
    argv = sys.argv[1:]
    args = parse(argv)
    if args.nproc_per_node <= 1 or "RANK" in os.environ:
        return _collected(rank_main(argv))
    status = launch(rank_main, argv, args.nproc_per_node)
    finished(args, stopped=status == EXIT_RELEASED)
    return status


def launch(rank_main: Callable[[list[str]], int], argv: list[str], ranks: int) -> int:
    """Run ``rank_main(argv)`` in ``ranks`` processes that form a gloo group on loopback
    (what torchrun does, minus its agent): the status is EXIT_RELEASED when every rank
    left at the release (torchrun would report that as a failed run), else the first
    rank's non-zero status, else 0. Forked where the system can, so the ranks start at
    once instead of importing torch again (the parent has imported it, run nothing)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    shared = {ENV_LAUNCHED: "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
              "WORLD_SIZE": str(ranks)}
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    if context.get_start_method() == "fork" and "torch" in sys.modules:
        # A rank's first optimizer imports torch._dynamo (some 800 modules, 3-8 s of CPU
        # here): imported once before the fork, not once per rank after --release-in
        # started counting (on one loaded core the first step came 13 s after it).
        importlib.import_module("torch._dynamo")
    processes = [
        context.Process(target=_rank, args=(rank_main, argv, {**shared, "RANK": str(rank),
                                                               "LOCAL_RANK": str(rank)}))
        for rank in range(ranks)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    statuses = [process.exitcode for process in processes]
    if all(status == EXIT_RELEASED for status in statuses):
        return EXIT_RELEASED
    return next((status or 1 for status in statuses if status != 0), 0)


def _rank(rank_main: Callable[[list[str]], int], argv: list[str],
          environ: dict[str, str]) -> None:
    os.environ.update(environ)
    raise SystemExit(_collected(rank_main(argv)))


def _collected(status: int) -> int:
    # Collect reference cycles now, while the interpreter is whole. Left to its shutdown,
    # torch 2.13 with gloo aborted about one run in seven here, after a clean
    # destroy_process_group ("terminate called without an active exception"), and torchrun
    # then reports a failed rank. With this: none in 50 runs.
    gc.collect()
    return status
