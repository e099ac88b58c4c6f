"""docs/simulation.md's "Heavy checkpoints" section: the margin and late saves, measured.

Issue 23, items 4 and 5: where a save or an upload takes minutes, the fixed 120 s margin
is idle time and a short notice leaves no room for a padded save. The section runs the
heavy workloads (kept apart from WORKLOADS, so the main tables keep their reference set)
and the two upload stress workloads under the policies that differ in the margin and in
late saves, and states the defaults from the figures it computed. report.py renders the
rest of the document; the CLI appends this section to it (``write_heavy_section``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Optional

from sidecar.tools.simulate.engine import DEFAULT_NOTICE_DELAY_SECONDS, Result, run
from sidecar.tools.simulate.report import TARGET_SLACK
from sidecar.tools.simulate.workloads import HEAVY_WORKLOADS, get_workload

__all__ = [
    "HEAVY_POLICIES",
    "HEAVY_SECTION_WORKLOADS",
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
BOUND_POLICY = "worst-case"
# The main document's workloads whose target is missed or tight, beside the heavy ones.
BOUND_EXTRA_WORKLOADS = ("slow-saves", "upload-3min", "spot-notice-120s")
_BOUND_EXTRA_POLICIES = (BOUND_POLICY, "sidecar", "sidecar-auto-margin", "oracle")
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
    ``BOUND_POLICY``, the floor's comparison on ``BOUND_EXTRA_WORKLOADS``, then the
    sidecar with and without late saves on ``LATE_COST_WORKLOAD``."""
    results = run(list(HEAVY_SECTION_WORKLOADS), [*HEAVY_POLICIES, BOUND_POLICY], seeds,
                  seed0, notice_delay_seconds=notice_delay_seconds, progress=progress)
    results += run(list(BOUND_EXTRA_WORKLOADS), list(_BOUND_EXTRA_POLICIES), seeds, seed0,
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


def _limit_seconds(results: Sequence[Result], workload: str) -> Optional[float]:
    """The target on ``workload``: the oracle's median lost time x 1.1 + one step (the
    main document's Target), None where the oracle did not run."""
    oracle = _by(results).get((workload, "oracle"))
    if oracle is None:
        return None
    return oracle.lost_median_seconds * (1 + TARGET_SLACK) + get_workload(workload).step_seconds


def _bound_rows(results: Sequence[Result]) -> list[tuple[str, float, Result, Result, Result]]:
    """``(workload, limit, floor, sidecar, auto margin)`` where one save fits and all ran."""
    by = _by(results)
    rows = []
    for workload in (*HEAVY_SECTION_WORKLOADS, *BOUND_EXTRA_WORKLOADS):
        limit = _limit_seconds(results, workload)
        bound, ours, auto = (by.get((workload, p))
                             for p in (BOUND_POLICY, "sidecar", "sidecar-auto-margin"))
        if (limit is not None and bound is not None and ours is not None and auto is not None
                and ours.feasible_runs):
            rows.append((workload, limit, bound, ours, auto))
    return rows


def _bound_table(results: Sequence[Result]) -> str:
    """Per workload where one save fits: the target, the floor ``BOUND_POLICY`` reaches
    and the sidecar's figures, default and auto margin."""
    lines = [
        f"| workload | limit s (oracle x 1.1 + one step) | {BOUND_POLICY} median lost s "
        "(missed) | sidecar median lost s (missed) | sidecar-auto-margin median lost s "
        "(missed) |",
        "|---|---:|---:|---:|---:|",
    ]
    for workload, limit, *cells in _bound_rows(results):
        lines.append(f"| {workload} | {limit:.0f} | " + " | ".join(
            f"{c.lost_median_seconds:.0f} ({c.misses})" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _bound_text(results: Sequence[Result]) -> str:
    """Where the target is out of reach of a one-save policy that never misses, where
    the sidecar meets it, and what the sidecar pays against the floor elsewhere."""
    beyond, met, gaps = [], [], []
    for workload, limit, bound, ours, _auto in _bound_rows(results):
        if ours.lost_median_seconds <= limit and ours.misses == 0:
            met.append(workload)
        elif bound.lost_median_seconds > limit:
            beyond.append(f"{workload} ({bound.lost_median_seconds:.0f} s against "
                          f"{limit:.0f} s)")
        else:
            gaps.append(f"{workload} ({ours.lost_median_seconds:.0f} s and {ours.misses} "
                        f"missed, against {bound.lost_median_seconds:.0f} s and "
                        f"{bound.misses})")
    return (
        f"`{BOUND_POLICY}` knows each workload's limits but not its draws: the longest "
        "step, save and upload it can draw (a link that may halve taken at its worst; "
        "lognormal uploads, which have no longest, at their 99.9th percentile, a cut in "
        "about 1000 releases, so a budget that accepts a larger chance of a cut, as the "
        "sidecar's does there, can lose less). It saves once, at the last step from which all three still "
        "end by the deadline it knows, and exits. A policy that makes one final save and "
        "never misses, and knows no more than the limits, cannot lose less; the sidecar "
        "knows less: it measures its own steps and saves, and reads the daemon's estimate "
        "of the upload. The floor is above the target on "
        f"{_listed(beyond, 'no workload here')}: the target asks a one-save policy there "
        "to know the next save's or upload's duration, or to accept cut saves. The sidecar "
        f"meets the target on {_listed(met, 'no workload here')}. Elsewhere the floor "
        f"meets it and the sidecar's default does not: {_listed(gaps, 'nowhere here')}. "
        "That is the price of budgeting from measurements (the 120 s margin, x1.2 on the "
        "saves measured and on the upload estimate, a fallback save) where the floor "
        "budgets the true limits, which a job does not know: a longer save, a slower link "
        "or a link that halves during the final upload is what the margin is for, and "
        "the floor, which pays for a halving link on every upload where one may come, "
        "would cost every job with an upload as much.\n"
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
        + "\n### What one save can reach\n\n" + _bound_table(results) + "\n"
        + _bound_text(results)
    )


def write_heavy_section(path: Path, results: Sequence[Result], seeds: int) -> None:
    """Append the section to the document ``path`` that report.py wrote."""
    with path.open("a") as handle:
        handle.write(render_heavy(results, seeds))
