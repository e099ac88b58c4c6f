"""Results as a table, a CSV file and a PNG plot; the top-up target per workload.

``esi-sidecar simulate`` prints :func:`render_table` and, with ``--out``, writes the CSV
and the plot. docs/simulation.md (the table, its prose and the target) is written by the
repository's ``tools/simulation_report.py``, which is not in the wheel. matplotlib is
imported only by :func:`write_plot`: the core stays stdlib-only.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from sidecar.tools.simulate.engine import Result
from sidecar.tools.simulate.workloads import WORKLOADS, get_workload

__all__ = [
    "INFEASIBLE",
    "PLOT_POLICIES",
    "TARGET_SLACK",
    "Target",
    "feasible_text",
    "is_stress",
    "minutes",
    "misses_text",
    "render_table",
    "targets",
    "write_csv",
    "write_plot",
    "write_results",
]

INFEASIBLE = "lead time < step + save and its upload"


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


def feasible_text(result: Result) -> str:
    text = f"{result.feasible_runs}/{result.runs}"
    return text if result.feasible_runs else f"{text}: {INFEASIBLE}"


def misses_text(result: Result) -> str:
    if not result.feasible_runs:
        return f"({result.infeasible_misses} infeasible)"
    text = str(result.misses)
    return text + (f" (+{result.infeasible_misses} infeasible)" if result.infeasible_misses else "")


def render_table(results: Sequence[Result]) -> str:
    """One row per (workload, policy): the table printed by the CLI and kept in the doc."""
    lines = [
        "| workload | policy | feasible runs | missed | lost min (median / mean / p95 / max) "
        "| saves | saves in final window (mean / max) | cut by reclaim | saving min | idle min |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lost = (f"{minutes(r.lost_median_seconds)} / {minutes(r.lost_mean_seconds)} / "
                f"{minutes(r.lost_p95_seconds)} / {minutes(r.lost_max_seconds)}")
        lines.append(
            f"| {r.workload} | {r.policy} | {feasible_text(r)} | {misses_text(r)} | {lost} "
            f"| {r.saves_mean:.2f} | {r.window_saves_mean:.2f} / {r.window_saves_max} "
            f"| {r.interrupted_saves} | {minutes(r.saving_mean_seconds)} "
            f"| {minutes(r.idle_mean_seconds)} |"
        )
    return "\n".join(lines) + "\n"


def is_stress(name: str) -> bool:
    workload = WORKLOADS.get(name)
    return workload is not None and bool(workload.stress)


@dataclass(frozen=True)
class Target:
    """The top-up target on one workload: median GPU time lost per reclaim no more than
    the oracle's + one step + 10 % (of the oracle's), no miss, at most two saves."""

    workload: str
    oracle_seconds: float
    step_seconds: float
    policy_seconds: float
    misses: int
    window_saves_max: int

    @property
    def limit_seconds(self) -> float:
        return self.oracle_seconds * (1 + TARGET_SLACK) + self.step_seconds

    @property
    def met(self) -> bool:
        return (self.policy_seconds <= self.limit_seconds and self.misses == 0
                and self.window_saves_max <= 2)


TARGET_SLACK = 0.10


def targets(results: Sequence[Result], policy: str = "sidecar",
            workloads: Optional[Sequence[str]] = None) -> list[Target]:
    """The target per workload where both ``policy`` and the oracle ran and runs were
    feasible: the reference workloads, in the order run, or ``workloads`` (stress ones
    included) in that order."""
    by_key = {(r.workload, r.policy): r for r in results}
    names = workloads if workloads is not None else [
        name for name in dict.fromkeys(r.workload for r in results) if not is_stress(name)]
    rows = []
    for name in names:
        ours, oracle = by_key.get((name, policy)), by_key.get((name, "oracle"))
        if ours is None or oracle is None or not ours.feasible_runs:
            continue
        rows.append(Target(
            workload=name, oracle_seconds=oracle.lost_median_seconds,
            step_seconds=get_workload(name).step_seconds,
            policy_seconds=ours.lost_median_seconds, misses=ours.misses,
            window_saves_max=ours.window_saves_max,
        ))
    return rows


def write_csv(results: Sequence[Result], path: Path) -> None:
    buffer = io.StringIO()
    names = [*asdict(results[0]), "feasible"] if results else []
    writer = csv.DictWriter(buffer, fieldnames=names, lineterminator="\n")
    writer.writeheader()
    for r in results:
        row = {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(r).items()}
        row["feasible"] = feasible_text(r)
        writer.writerow(row)
    path.write_text(buffer.getvalue())


# The policies the plot shows when they were run (the sidecar's variants differ from it on
# a few workloads only: the tables show them); any other run is plotted whole.
PLOT_POLICIES = ("periodic-30", "verl", "sidecar-previous", "sidecar", "sidecar+periodic-30",
                 "oracle")


def write_plot(results: Sequence[Result], path: Path) -> None:
    """Lost minutes per reclaim, one group of bars per workload; value and misses on bars.

    Horizontal bars on a symlog axis: losses span 0 (the sidecar) to hours (a lost
    final save), and every bar carries its number so a zero stays visible. Only
    ``PLOT_POLICIES`` when at least two of them were run.
    """
    import matplotlib  # lazily: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in results))
    policies = list(dict.fromkeys(r.policy for r in results))
    shown = [p for p in PLOT_POLICIES if p in policies]
    policies = shown if len(shown) >= 2 else policies
    by_key = {(r.workload, r.policy): r for r in results}
    height = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.16 * len(workloads) * len(policies)))
    colors = plt.get_cmap("tab10")
    for p_index, policy in enumerate(policies):
        ys, values = [], []
        for w_index, workload in enumerate(workloads):
            result = by_key.get((workload, policy))
            if result is None:
                continue
            y = w_index + (p_index - (len(policies) - 1) / 2) * height
            value = result.lost_median_seconds / 60
            ys.append(y)
            values.append(value)
            misses = result.misses if result.feasible_runs else result.infeasible_misses
            label = f"{value:.1f} min"
            if misses:
                label += f", {misses}/{result.runs} missed"
            if not result.feasible_runs:
                label += " (infeasible)"
            ax.text(value * 1.08 + 0.02, y, label, va="center", fontsize=7)
        ax.barh(ys, values, height=height * 0.9, color=colors(p_index % 10), label=policy)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlim(0, 2000)
    ax.set_yticks(range(len(workloads)))
    ax.set_yticklabels(
        [w + (" (stress)" if is_stress(w) else "") for w in workloads], fontsize=9
    )
    ax.invert_yaxis()
    ax.set_xlabel("median GPU minutes lost per reclaim (per GPU; symlog scale)")
    ax.set_title("Work lost at the reclaim, by workload and policy (text: missed deadlines)",
                 pad=22)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=min(len(policies), 6),
              fontsize=8,
              frameon=False, handlelength=1.2, columnspacing=1.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(results: Sequence[Result], out: Path, *, plot: bool = True) -> list[Path]:
    """Write simulation.csv and (with ``plot``) simulation.png into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "simulation.csv"]
    write_csv(results, written[0])
    if plot:
        written.append(out / "simulation.png")
        write_plot(results, written[1])
    return written
