"""docs/simulation.md's "Heavy checkpoints" section: the margin and late saves, measured.

Not in the wheel: simulation_report.py runs it and appends the section it renders.

Issue 23, items 4 and 5: where a save or an upload takes minutes, the fixed 120 s margin
is idle time and a short notice leaves no room for a padded save. The section runs the
heavy workloads (kept apart from WORKLOADS, so the main tables keep their reference set)
and the two upload stress workloads under the policies that differ in the margin and in
late saves, and states the defaults from the figures it computed. simulation_report.py
renders the rest of the document and appends this section to it (``write_heavy_section``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sidecar.tools.simulate.engine import DEFAULT_NOTICE_DELAY_SECONDS, Result, run
from sidecar.tools.simulate.table import TARGET_SLACK
from sidecar.tools.simulate.workloads import HEAVY_WORKLOADS, get_workload

__all__ = [
    "FLOOR_EXTRA_WORKLOADS",
    "FLOOR_POLICY",
    "HEAVY_POLICIES",
    "HEAVY_SECTION_WORKLOADS",
    "FloorRow",
    "floor_verdicts",
    "render_heavy",
    "run_heavy",
    "write_heavy_section",
]

HEAVY_SECTION_WORKLOADS: tuple[str, ...] = (*HEAVY_WORKLOADS, "upload-lognormal", "link-halves")
HEAVY_POLICIES: tuple[str, ...] = (
    "sidecar-previous", "sidecar-no-fallback", "sidecar-no-late", "sidecar",
    "sidecar-auto-margin", "oracle",
)
# The floor for one-save policies that never miss, beside the target: its own table.
FLOOR_POLICY = "worst-case"
# The main document's workloads whose target is missed or tight, beside the heavy ones.
FLOOR_EXTRA_WORKLOADS = ("slow-saves", "upload-3min", "spot-notice-120s")
_FLOOR_EXTRA_POLICIES = (FLOOR_POLICY, "sidecar", "sidecar-auto-margin", "oracle")
# A late save's cost shows where the notice is about one save long: run for the paragraph,
# not shown in the table.
LATE_COST_WORKLOAD = "spot-notice-60s"
_LATE_COST_POLICIES = ("sidecar-no-late", "sidecar")
# Differences in median lost time below this are noise of the draw, not a gain or a cost.
_SAME_SECONDS = 5.0


def run_heavy(
    seeds: int,
    seed0: int = 0,
    *,
    notice_delay_seconds: float = DEFAULT_NOTICE_DELAY_SECONDS,
    progress: Optional[Callable[[float], None]] = None,
) -> list[Result]:
    """The section's runs: every heavy-section workload under ``HEAVY_POLICIES`` and
    ``FLOOR_POLICY``, the floor's comparison on ``FLOOR_EXTRA_WORKLOADS``, then the
    sidecar with and without late saves on ``LATE_COST_WORKLOAD``."""
    results = run(list(HEAVY_SECTION_WORKLOADS), [*HEAVY_POLICIES, FLOOR_POLICY], seeds,
                  seed0, notice_delay_seconds=notice_delay_seconds, progress=progress)
    results += run(list(FLOOR_EXTRA_WORKLOADS), list(_FLOOR_EXTRA_POLICIES), seeds, seed0,
                   notice_delay_seconds=notice_delay_seconds)
    return results + run([LATE_COST_WORKLOAD], list(_LATE_COST_POLICIES), seeds, seed0,
                         notice_delay_seconds=notice_delay_seconds)


def _by(results: Sequence[Result]) -> dict[tuple[str, str], Result]:
    return {(r.workload, r.policy): r for r in results}


def _table(results: Sequence[Result]) -> str:
    lines = [
        "| workload | policy | median lost s | mean lost s | missed / feasible runs "
        "| missed where no save fits | saves per deadline (mean / max) | saving s | idle s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by = _by(results)
    for workload in HEAVY_SECTION_WORKLOADS:
        for policy in HEAVY_POLICIES:
            r = by.get((workload, policy))
            if r is not None:
                lines.append(
                    f"| {workload} | {policy} | {r.lost_median_seconds:.0f} "
                    f"| {r.lost_mean_seconds:.0f} | {r.misses} / {r.feasible_runs} "
                    f"| {r.infeasible_misses} / {r.infeasible_runs} "
                    f"| {r.window_saves_mean:.2f} / {r.window_saves_max} "
                    f"| {r.saving_mean_seconds:.0f} | {r.idle_mean_seconds:.0f} |"
                )
    return "\n".join(lines) + "\n"


def _compare(results: Sequence[Result], policy: str,
             base_policy: str = "sidecar") -> tuple[list[str], list[str]]:
    """Where ``policy`` loses less than ``base_policy``, and where it loses more or
    misses more: one phrase per workload, from the figures."""
    by = _by(results)
    helps, costs = [], []
    for workload in HEAVY_SECTION_WORKLOADS:
        mine, base = by.get((workload, policy)), by.get((workload, base_policy))
        if mine is None or base is None:
            continue
        phrase = (f"{workload} ({base.lost_median_seconds:.0f} -> "
                  f"{mine.lost_median_seconds:.0f} s median lost, misses "
                  f"{base.misses + base.infeasible_misses} -> "
                  f"{mine.misses + mine.infeasible_misses})")
        misses = (mine.misses + mine.infeasible_misses) - (base.misses + base.infeasible_misses)
        if misses > 0 or mine.lost_median_seconds > base.lost_median_seconds + _SAME_SECONDS:
            costs.append(phrase)
        elif misses < 0 or mine.lost_median_seconds < base.lost_median_seconds - _SAME_SECONDS:
            helps.append(phrase)
    return helps, costs


def _most_saved(results: Sequence[Result], policy: str) -> str:
    by = _by(results)
    gains = [by[(w, "sidecar")].lost_median_seconds - by[(w, policy)].lost_median_seconds
             for w in HEAVY_SECTION_WORKLOADS if (w, policy) in by and (w, "sidecar") in by]
    return f"{max([0.0, *gains]):.0f}"


def _listed(phrases: Sequence[str], none: str) -> str:
    return "; ".join(phrases) if phrases else none


def _margin_text(results: Sequence[Result]) -> str:
    helps, costs = _compare(results, "sidecar-auto-margin")
    return (
        "`SavePolicy(redundant_seconds=\"auto\")` (`sidecar-auto-margin`) chooses the margin "
        "that loses least from the measured steps, saves and upload estimate. Against the "
        f"fixed 120 s it loses less on {_listed(helps, 'no workload here')}. It costs on "
        f"{_listed(costs, 'no workload here')}. **The fixed 120 s stays the default**: "
        f"the most the auto margin saves here is {_most_saved(results, 'sidecar-auto-margin')}"
        " s of median lost time per release, and its safety rests on the spread measured "
        "so far, so a job whose saves change (a larger checkpoint, a slower disk) is cut "
        "before its measurements show it, where 120 s holds; a job whose checkpoints take "
        "minutes opts in.\n"
    )


def _late_text(results: Sequence[Result]) -> str:
    helps, costs = _compare(results, "sidecar", "sidecar-no-late")
    by = _by(results)
    cost_line = ""
    base, late = by.get((LATE_COST_WORKLOAD, "sidecar-no-late")), by.get(
        (LATE_COST_WORKLOAD, "sidecar"))
    if base is not None and late is not None:
        cost_line = (
            f" On {LATE_COST_WORKLOAD} (a notice about one save long, not in the table) the "
            f"reclaim cuts a save in {late.interrupted_saves} of {late.runs} runs, against "
            f"{base.interrupted_saves} of {base.runs} without late saves (median lost "
            f"{base.lost_median_seconds:.0f} -> {late.lost_median_seconds:.0f} s, mean "
            f"{base.lost_mean_seconds:.0f} -> {late.lost_mean_seconds:.0f} s): a cut save "
            "costs the time it took, and before a SIGTERM's end the clean exit."
        )
    verdict = (
        "**`try_late_saves=\"auto\"` is the default**: late saves where the deadline is the "
        "machine's end, none before the process's (a SIGTERM grace, a Slurm time limit, a "
        "deadline from the environment), where a job killed mid-save gives its scheduler "
        "no exit 75 to requeue on."
        if not costs else
        "The figures show a cost: the default should be revisited."
    )
    return (
        "`SavePolicy(try_late_saves=\"auto\")` (the default, `sidecar`) starts a save that "
        "its padded estimate says will not end in time when its expected time, without "
        "the x1.2, still fits and the deadline is the machine's (every simulated one is); "
        "`sidecar-no-late` (`try_late_saves=False`, the default before) never does. Late "
        f"saves help on {_listed(helps, 'no workload here')}. They cost on "
        f"{_listed(costs, 'no workload here')}.{cost_line} {verdict}\n"
    )


def _fallback_text(results: Sequence[Result]) -> str:
    """The fallback save's gain (the tail: mean lost) and cost (median, saving time)."""
    by = _by(results)
    phrases = []
    for workload in HEAVY_SECTION_WORKLOADS:
        mine, base = by.get((workload, "sidecar")), by.get((workload, "sidecar-no-fallback"))
        if mine is None or base is None or mine.saves_mean <= base.saves_mean + 0.01:
            continue  # no fallback save made there
        phrases.append(
            f"{workload} (mean lost {base.lost_mean_seconds:.0f} -> "
            f"{mine.lost_mean_seconds:.0f} s, median {base.lost_median_seconds:.0f} -> "
            f"{mine.lost_median_seconds:.0f} s, misses {base.misses} -> {mine.misses}, "
            f"saving {base.saving_mean_seconds:.0f} -> {mine.saving_mean_seconds:.0f} s)")
    return (
        "`SavePolicy(fallback_saves=True)` (the default, `sidecar`; `sidecar-no-fallback` "
        "without) makes one save before the final one when that one rests on an upload "
        "longer than the margin, timed so that its own upload ends before the final save "
        "starts (`sidecar.train.fallback`). Where it was made: "
        f"{_listed(phrases, 'nowhere here')}. A final upload that a slowing link makes end "
        "after the release then costs the training since the fallback (minutes), not all "
        "since the checkpoint before (hours); such a release still counts as missed, since "
        "the fallback ends before the final window. Its cost is one more save per release, "
        "and a final save made a little earlier while the daemon's estimate rests on its "
        "first uploads (the estimate carried in the checkpoint stays a floor until ten "
        "uploads were measured: docs/upload.md).\n"
    )


@dataclass(frozen=True)
class FloorRow:
    """One workload where one save fits: the sidecar's default against issue 37's target,
    the floor x 1.1 + one step (the floor: ``FLOOR_POLICY``'s median lost), with no miss;
    the auto margin and the oracle beside it."""

    workload: str
    step_seconds: float
    floor: Result
    ours: Result
    auto: Result
    oracle: Result

    @property
    def limit_seconds(self) -> float:
        return self.floor.lost_median_seconds * (1 + TARGET_SLACK) + self.step_seconds

    @property
    def over_seconds(self) -> float:
        """How far the sidecar's median lost is above the limit (negative: below)."""
        return self.ours.lost_median_seconds - self.limit_seconds

    @property
    def met(self) -> bool:
        return self.over_seconds <= 0 and self.ours.misses == 0


def _floor_rows(results: Sequence[Result]) -> list[FloorRow]:
    by = _by(results)
    rows = []
    for workload in (*HEAVY_SECTION_WORKLOADS, *FLOOR_EXTRA_WORKLOADS):
        found = [by.get((workload, policy)) for policy in
                 (FLOOR_POLICY, "sidecar", "sidecar-auto-margin", "oracle")]
        floor, ours, auto, oracle = found
        if floor is None or ours is None or auto is None or oracle is None:
            continue
        if ours.feasible_runs:  # one save fits after the deadline is learned
            rows.append(FloorRow(workload, get_workload(workload).step_seconds,
                                 floor, ours, auto, oracle))
    return rows


def _floor_table(results: Sequence[Result]) -> str:
    lines = [
        f"| workload | floor: {FLOOR_POLICY} median lost s (missed) | limit s (floor x 1.1 "
        "+ one step) | sidecar median lost s (missed) | sidecar over the limit s "
        "| sidecar-auto-margin median lost s (missed) | oracle median lost s | met |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in _floor_rows(results):
        lines.append(
            f"| {row.workload} | {row.floor.lost_median_seconds:.0f} ({row.floor.misses}) "
            f"| {row.limit_seconds:.0f} "
            f"| {row.ours.lost_median_seconds:.0f} ({row.ours.misses}) "
            f"| {row.over_seconds:+.0f} "
            f"| {row.auto.lost_median_seconds:.0f} ({row.auto.misses}) "
            f"| {row.oracle.lost_median_seconds:.0f} "
            f"| {'yes' if row.met else '**no**'} |")
    return "\n".join(lines) + "\n"


def floor_verdicts(results: Sequence[Result]) -> dict[str, list[str]]:
    """Each workload of the floor's table in exactly one list: ``met`` (the sidecar's
    default meets the target), ``below`` (the sidecar loses less than the floor, and so
    meets the target if it misses nothing: the floor is not one there), ``gap`` (the
    sidecar above the target)."""
    verdicts: dict[str, list[str]] = {"met": [], "below": [], "gap": []}
    for row in _floor_rows(results):
        key = ("met" if row.met and row.ours.lost_median_seconds >= row.floor.lost_median_seconds
               else "below" if row.ours.lost_median_seconds < row.floor.lost_median_seconds
               else "gap")
        verdicts[key].append(row.workload)
    return verdicts


def _floor_text(results: Sequence[Result]) -> str:
    rows = {row.workload: row for row in _floor_rows(results)}
    verdicts = floor_verdicts(results)

    def figures(name: str) -> str:
        row = rows[name]
        return (f"{name} (sidecar {row.ours.lost_median_seconds:.0f} s, {row.ours.misses} "
                f"missed; floor {row.floor.lost_median_seconds:.0f} s, {row.floor.misses} "
                f"missed; limit {row.limit_seconds:.0f} s)")

    def listed(key: str) -> str:
        return _listed([figures(name) for name in verdicts[key]], "none")

    auto = [f"{name} {row.ours.lost_median_seconds:.0f} -> {row.auto.lost_median_seconds:.0f} s"
            for name, row in rows.items()
            if row.auto.lost_median_seconds < row.ours.lost_median_seconds - _SAME_SECONDS]
    return (
        f"The target (issue 37): on every workload where one save fits after the deadline "
        "is learned, no miss and a median loss within the floor x 1.1 + one step. "
        f"The floor, `{FLOOR_POLICY}`, knows each workload's limits but not its draws: the "
        "longest step, save and upload it can draw (where the link may halve, every upload "
        "at half speed; lognormal uploads, which have no longest, at their 99.9th "
        "percentile). The daemon streams the upload while the save writes it, so the "
        "longest from a save's start to durable is the longer of the longest save and the "
        "longest upload, then the commit. It saves once, at the last step from which the "
        "longest step and that still end by the deadline it knows, then exits, so a release "
        "moved later costs it the extension. Where steps, saves and uploads are drawn "
        "independently and have a longest, no policy that makes one final save and can "
        "miss on no draw loses less without knowing more than the limits. The sidecar "
        "knows neither the limits nor the coming draws: it estimates them from the steps "
        "and saves it measured and the daemon's upload estimate.\n\n"
        f"- **Met** by the sidecar's default: {listed('met')}.\n"
        f"- **The sidecar below the floor**: {listed('below')}. There the floor is not "
        "one: the uploads have no longest, and the sidecar's budget (the daemon's slow-tail "
        "estimate x1.2, the margin) accepts a small chance of a cut.\n"
        f"- **The sidecar above the target**: {listed('gap')}. Its final save's budget is "
        "the longest step measured, the padded save (x1.2), the daemon's estimate from the "
        "save's end to durable (x1.2, counting a checkpoint still uploading whole), and the "
        "120 s margin; the floor's is the longest step and the longer of save and upload. "
        "Where the upload is longer than the margin, the fallback save adds one more. The "
        f"auto margin (opt-in) closes part of it: {_listed(auto, 'nowhere here')}.\n"
    )


def render_heavy(results: Sequence[Result], seeds: int) -> str:
    """The section's markdown, from :func:`run_heavy`'s results."""
    return (
        "\n## Heavy checkpoints\n\n"
        "Saves or uploads of minutes (issue 23): the heavy workloads, whose jobs resumed with "
        "5 saves measured, and the upload stress workloads, under the policies that differ "
        f"in the fallback save, late saves and the margin ({seeds} seeds each; a run is "
        "feasible when one save and its upload fit after the deadline is learned, "
        "Metrics; saves per deadline are the saves ending in the final window; saving s "
        "and idle s are means per release).\n\n"
        + _table(results)
        + "\n### The fallback save\n\n" + _fallback_text(results)
        + "\n### Late saves\n\n" + _late_text(results)
        + "\n### Choosing the margin\n\n" + _margin_text(results)
        + "\n### What one save can reach\n\n" + _floor_table(results) + "\n"
        + _floor_text(results)
    )


def write_heavy_section(path: Path, results: Sequence[Result], seeds: int) -> None:
    """Append the section to the document ``path`` that simulation_report.py wrote."""
    with path.open("a") as handle:
        handle.write(render_heavy(results, seeds))
