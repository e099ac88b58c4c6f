"""docs/simulation.md's "Heavy checkpoints" section (issue 23, items 4 and 5; the fallback save)."""

from __future__ import annotations

import sys
from pathlib import Path

from sidecar.tools.simulate.engine import run
from sidecar.tools.simulate.workloads import get_workload

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import simulation_report  # noqa: E402  (docs/simulation.md's writer, not in the wheel)
from simulation_heavy import (  # noqa: E402
    FLOOR_EXTRA_WORKLOADS,
    FLOOR_POLICY,
    HEAVY_POLICIES,
    HEAVY_SECTION_WORKLOADS,
    floor_verdicts,
    render_heavy,
    run_heavy,
)


def test_the_section_has_a_row_per_workload_and_policy_and_states_the_defaults() -> None:
    results = run_heavy(seeds=3)
    text = render_heavy(results, seeds=3)
    assert text.startswith("\n## Heavy checkpoints\n")
    for workload in HEAVY_SECTION_WORKLOADS:
        for policy in HEAVY_POLICIES:
            assert f"| {workload} | {policy} | " in text
    assert "| spot-notice-60s |" not in text  # only in the late-saves paragraph
    fallback = text.split("### The fallback save\n")[1].split("### Late saves")[0]
    late = text.split("### Late saves\n")[1].split("### Choosing the margin")[0]
    margin = text.split("### Choosing the margin\n")[1]
    assert "**The fixed 120 s stays the default**" in margin
    assert "spot-notice-60s" in late
    assert ("**`try_late_saves=\"auto\"` is the default**" in late
            or "the default should be revisited" in late)
    # The fallback save is made where the upload is longer than the margin, and named there
    # with its figures; nowhere without an upload.
    by = {(r.workload, r.policy): r for r in results}
    with_it, without = by[("heavy-upload", "sidecar")], by[("heavy-upload", "sidecar-no-fallback")]
    assert with_it.saves_mean > without.saves_mean
    assert (f"heavy-upload (mean lost {without.lost_mean_seconds:.0f} -> "
            f"{with_it.lost_mean_seconds:.0f} s") in fallback
    assert "heavy-saves (" not in fallback
    assert by[("heavy-saves", "sidecar")].saves_mean == by[
        ("heavy-saves", "sidecar-no-fallback")].saves_mean
    # The figures are the computed ones: the auto margin's gain on heavy-saves is named.
    fixed = by[("heavy-saves", "sidecar")].lost_median_seconds
    auto = by[("heavy-saves", "sidecar-auto-margin")].lost_median_seconds
    assert f"heavy-saves ({fixed:.0f} -> {auto:.0f} s median lost" in margin


def test_cli_out_appends_the_section_after_the_main_document(tmp_path: Path) -> None:
    assert simulation_report.main(
        ["--seeds", "2", "--workload", "steady", "--policy", "sidecar",
         "--no-plot", "--no-top-up-sweep", "--out", str(tmp_path)]) == 0
    doc = (tmp_path / "simulation.md").read_text()
    assert doc.index("| steady | sidecar |") < doc.index("## Heavy checkpoints")
    assert "| heavy-upload | sidecar-auto-margin | " in doc and "(2 seeds each" in doc


def test_the_floor_is_set_beside_the_target_and_each_workload_has_one_verdict() -> None:
    # Issue 37's target: the floor (the limits-knowing one-save policy) x 1.1 + one step.
    results = run_heavy(seeds=4)
    text = render_heavy(results, seeds=4)
    section = text.split("### What one save can reach\n")[1]
    table, verdict_text = section.split("|\n\n", 1)
    by = {(r.workload, r.policy): r for r in results}
    verdicts = floor_verdicts(results)
    named = [name for names in verdicts.values() for name in names]
    assert len(named) == len(set(named))  # one verdict each
    for workload in ("heavy-saves", "heavy-upload", *FLOOR_EXTRA_WORKLOADS):
        assert workload in named
        floor, ours = by[(workload, FLOOR_POLICY)], by[(workload, "sidecar")]
        limit = floor.lost_median_seconds * 1.1 + get_workload(workload).step_seconds
        over = ours.lost_median_seconds - limit
        assert (f"| {workload} | {floor.lost_median_seconds:.0f} ({floor.misses}) "
                f"| {limit:.0f} | {ours.lost_median_seconds:.0f} ({ours.misses}) "
                f"| {over:+.0f} |") in table
        # The verdicts follow the figures.
        if workload in verdicts["met"]:
            assert ours.misses == 0 and over <= 0
        if workload in verdicts["gap"]:
            assert ours.misses > 0 or over > 0
            assert f"{workload} (sidecar " in verdict_text.split("**The sidecar above")[1]
        if workload in verdicts["below"]:
            assert ours.lost_median_seconds < floor.lost_median_seconds
    # No short-notice workload (no save fits): no row.
    assert "| gcp-notice-30s-heavy |" not in section


def test_the_floor_streams_the_upload_while_it_saves() -> None:
    # 45 s saves, 300 s uploads: the floor budgets the longer (the upload, streamed from
    # the save's start) and the commit, not the save and then the upload.
    workload = get_workload("heavy-upload")
    (floor,) = run(["heavy-upload"], [FLOOR_POLICY], seeds=10)
    assert floor.misses == 0
    assert workload.durable_max_seconds <= floor.lost_median_seconds
    assert floor.lost_median_seconds < workload.durable_max_seconds + workload.step_max_seconds
    assert floor.lost_median_seconds < workload.save_max_seconds + workload.upload_max_seconds
