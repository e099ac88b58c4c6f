"""The ``esi-sidecar simulate`` command.

A dev tool, not part of the training-side install: it drives the real
:class:`sidecar.train.guard.CheckpointGuard` (and verl's rule, and periodic saving) through
simulated runs. The core uses only the standard library (``random``), so it is cheap and
reproducible; matplotlib is imported only to draw the plot.

    from sidecar.tools.simulate.engine import run
    results = run(seeds=200)                                 # list[Result]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from sidecar.tools.simulate.engine import DEFAULT_NOTICE_DELAY_SECONDS, Result, run
from sidecar.tools.simulate.policies import POLICIES
from sidecar.tools.simulate.table import render_table, write_results
from sidecar.tools.simulate.workloads import HEAVY_WORKLOADS, WORKLOADS

__all__ = [
    "QUICK_SEEDS",
    "REPORT_SEEDS",
    "add_run_arguments",
    "add_simulate_command",
    "matplotlib_missing",
    "progress",
    "run_selected",
]

# A plain `esi-sidecar simulate` is a quick look (issue 39: 200 seeds ran about 17 min);
# --out (the CSV and the plot) and docs/simulation.md (tools/simulation_report.py) keep
# the report's 200 seeds.
QUICK_SEEDS = 5
REPORT_SEEDS = 200
# One run (one workload, policy and seed), measured on the 2-core development machine:
# about 25 ms (17 workloads x 17 policies x 2 seeds in 14 s under load).
SECONDS_PER_RUN = 0.025


def add_simulate_command(subparsers: Any) -> None:
    """Add ``simulate`` to the CLI's sub-commands; ``args.func(args)`` returns an exit code.

    ``subparsers`` is what ``ArgumentParser.add_subparsers()`` returned (typed Any: its
    class is private to argparse).
    """
    parser = subparsers.add_parser(
        "simulate",
        help="simulate save policies against release deadlines (no sleeping)",
        description="Trace-driven simulation of periodic saving, verl's ESI rule and this "
        "project's policy on built-in workloads. Prints a markdown table; with --out, "
        "writes simulation.csv and simulation.png there. docs/simulation.md (the prose, "
        "the top-up sweep and the heavy checkpoints) is written from a checkout: "
        "python tools/simulation_report.py --out docs/",
    )
    add_run_arguments(parser, seeds_help=f"runs per workload and policy (default "
                      f"{QUICK_SEEDS}, about "
                      f"{_estimate(len(WORKLOADS) * len(POLICIES) * QUICK_SEEDS)}; with "
                      f"--out {REPORT_SEEDS}, the report's)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="write simulation.csv and simulation.png into DIR, not "
                        "simulation.md (default: print the table)")
    parser.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True,
                        help="with --out, draw simulation.png (default: yes)")
    parser.add_argument("--list", action="store_true",
                        help="list the workloads and policies, then exit")
    parser.set_defaults(func=simulate_command)


def add_run_arguments(parser: argparse.ArgumentParser, *, seeds_help: str) -> None:
    """The arguments that choose the runs, shared with tools/simulation_report.py:
    ``--seeds`` (None when not given), ``--seed0``, ``--workload``, ``--policy``,
    ``--notice-delay``."""
    parser.add_argument("--seeds", type=_positive_int, default=None, metavar="N",
                        help=seeds_help)
    parser.add_argument("--seed0", type=int, default=0, metavar="N",
                        help="first seed (default 0)")
    parser.add_argument("--workload", action="append", choices=[*WORKLOADS, *HEAVY_WORKLOADS],
                        metavar="NAME", help="simulate only this workload (repeatable; "
                        "default: all but the heavy ones, which docs/simulation.md runs for "
                        "their section)")
    parser.add_argument("--policy", action="append", choices=list(POLICIES), metavar="NAME",
                        help="simulate only this policy (repeatable; default: all)")
    parser.add_argument("--notice-delay", type=float, default=DEFAULT_NOTICE_DELAY_SECONDS,
                        metavar="S", help="seconds until the job learns of a deadline change "
                        f"(one daemon poll; default {DEFAULT_NOTICE_DELAY_SECONDS:g})")


def _estimate(runs: int) -> str:
    seconds = max(1.0, runs * SECONDS_PER_RUN)
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def progress(label: str, workloads: list[str]) -> Any:
    """Progress on stderr: a percentage redrawn in place on a terminal; elsewhere (a pipe,
    a log) a line now and one as each workload is done, so a minute of simulating is
    never a minute of silence (issue 26). stdout keeps the table alone."""
    if sys.stderr.isatty():
        def redraw(fraction: float) -> None:
            end = "\n" if fraction >= 1 else ""
            print(f"\r{label} ... {fraction:4.0%}", end=end, file=sys.stderr, flush=True)

        return redraw
    print(f"{label} ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    done = 0

    def line_per_workload(fraction: float) -> None:
        nonlocal done
        while done < min(len(workloads), int(fraction * len(workloads) + 1e-9)):
            done += 1
            print(f"  {workloads[done - 1]} done ({done}/{len(workloads)}, "
                  f"{time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)

    return line_per_workload


def simulate_command(args: argparse.Namespace) -> int:
    """Run the ``simulate`` sub-command; returns the process exit code."""
    if args.list:
        print("workloads:")
        for workload in [*WORKLOADS.values(), *HEAVY_WORKLOADS.values()]:
            stress = f" [stress: {workload.stress}]" if workload.stress else ""
            print(f"  {workload.name:20} {workload.description}{stress}")
        print("policies:")
        for policy in POLICIES.values():
            print(f"  {policy.name:20} {policy.description}")
        return 0
    if args.out is not None and args.plot and matplotlib_missing("esi-sidecar simulate"):
        return 2
    quick = args.seeds is None and args.out is None
    if args.seeds is None:
        args.seeds = QUICK_SEEDS if quick else REPORT_SEEDS
    results = run_selected(args, quick=quick)
    if args.out is None:
        print(render_table(results), end="")
        return 0
    for path in write_results(results, args.out, plot=args.plot):
        print(path)
    return 0


def matplotlib_missing(prog: str) -> bool:
    """Say so on stderr when the plot cannot be drawn: checked before minutes of
    simulating."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"{prog}: the plot needs matplotlib: "
              "pip install 'esi-sidecar[simulate]' (or pass --no-plot)", file=sys.stderr)
        return True
    return False


def run_selected(args: argparse.Namespace, *, quick: bool) -> list[Result]:
    """Run the workloads and policies that :func:`add_run_arguments` chose (all when none
    were named) for ``args.seeds`` seeds, saying on stderr how long it will take."""
    workloads = args.workload or list(WORKLOADS)
    policies = args.policy or list(POLICIES)
    label = (f"simulating {len(workloads)} workloads x {len(policies)} policies x {args.seeds} "
             f"seeds, about {_estimate(len(workloads) * len(policies) * args.seeds)}")
    if quick:
        label += f" (a quick look; the report's numbers: --seeds {REPORT_SEEDS})"
    return run(workloads, policies, seeds=args.seeds, seed0=args.seed0,
               notice_delay_seconds=args.notice_delay, progress=progress(label, workloads))
