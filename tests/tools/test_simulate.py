"""The simulator: our policy against moving deadlines, verl's rule, periodic saving, the CLI."""

from __future__ import annotations

import argparse
import csv
import math
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from sidecar.tools.simulate.command import add_simulate_command
from sidecar.tools.simulate.engine import (
    COMMIT_TAIL_SECONDS,
    Checkpoint,
    durable_times,
    run,
    simulate_run,
)
from sidecar.tools.simulate.policies import (
    POLICIES,
    Policy,
    PolicyFactory,
    RunInfo,
    SidecarPolicy,
    SidecarWithPeriodicPolicy,
    VerlPolicy,
    WorstCasePolicy,
)
from sidecar.tools.simulate.table import INFEASIBLE, render_table, targets
from sidecar.tools.simulate.workloads import WORKLOADS, DeadlineChange, Workload, get_workload
from sidecar.train.policy import SavePolicy

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import simulation_report  # noqa: E402  (docs/simulation.md's writer, not in the wheel)

REFERENCE = [name for name, workload in WORKLOADS.items() if not workload.stress]
SEEDS = 50
# Where no top-up fits after the final save (docs/simulation.md, "The top-up target").
# With uploads, the daemon's estimate right after the final save counts that checkpoint
# whole while it still uploads (streamed, it is durable soon after): no top-up fits.
NO_TOP_UP = {"slow-saves", "upload-1min", "upload-3min", "spot-notice-120s"}


def no_top_up(factory: Callable[[RunInfo], Policy], name: str) -> PolicyFactory:
    return PolicyFactory(name, "without the top-up save", factory)


CLASSIC = no_top_up(lambda run: SidecarWithPeriodicPolicy(30 * 60.0, top_up_seconds=None),
                    "sidecar+periodic-30, no top-up")


@pytest.mark.parametrize("policy", ["sidecar", "sidecar+periodic-30"])
def test_sidecar_misses_no_feasible_deadline_on_reference_workloads(policy: str) -> None:
    results = run(REFERENCE, [policy], seeds=SEEDS)
    assert {r.workload for r in results} == set(REFERENCE)
    for result in results:
        assert result.misses == 0, result
    assert sum(r.feasible_runs for r in results) >= (len(REFERENCE) - 2) * SEEDS


def test_top_up_target_on_the_reference_workloads() -> None:
    # The target: no miss, at most two saves per deadline, and a median loss
    # within the oracle's + one step + 10 %, on every reference workload where a top-up
    # fits after the final save; where none fits, one save as before, and no miss.
    results = run(REFERENCE, ["sidecar", "oracle", "sidecar-no-top-up"], seeds=SEEDS)
    rows = {t.workload: t for t in targets(results)}
    assert set(rows) == set(REFERENCE) - {"spot-notice-30s", "spot-notice-60s"}  # infeasible
    for t in rows.values():
        assert t.misses == 0 and t.window_saves_max <= 2, t
        assert t.oracle_seconds <= t.policy_seconds, t
    # Met wherever a top-up fits; one save per deadline where none does.
    assert {name for name, t in rows.items() if t.window_saves_max < 2} == NO_TOP_UP
    assert all(t.met for name, t in rows.items() if name not in NO_TOP_UP)
    assert not rows["upload-3min"].met  # the margin is large against the oracle's loss
    # The top-up is what meets it: without it every target with a top-up is missed.
    without = {t.workload: t for t in targets(results, "sidecar-no-top-up")}
    assert not any(t.met for name, t in without.items() if name not in NO_TOP_UP)


def test_short_notices_skip_a_save_that_cannot_end_or_try_it() -> None:
    # 60 s notices, learned within 2 s, 60 s +-10 % saves. Never trying late (the choice
    # for a process's deadline) starts no save the estimate says is too late, so none is
    # cut; the default on the machine's notice tries those whose expected time fits, and
    # trying always tries them all: each saves a few runs and cuts some.
    policies = ["sidecar-no-late", "sidecar", "sidecar-try-late"]
    results = run(["spot-notice-60s", "spot-notice-120s"], policies, seeds=SEEDS)
    by = {(r.workload, r.policy): r for r in results}
    skip, expected, tried = (by[("spot-notice-60s", policy)] for policy in policies)
    assert skip.interrupted_saves == 0 and skip.saves_mean == 0
    assert 0 < expected.interrupted_saves < tried.interrupted_saves
    assert expected.saves_mean > 0 and tried.saves_mean > 0  # some ended in time after all
    # With room for a save the three choices are the same run.
    same = {by[("spot-notice-120s", policy)].lost_mean_seconds for policy in policies}
    assert len(same) == 1, same


def test_durability_is_budgeted_and_a_renewal_is_not_wasted() -> None:
    results = run(["heavy-upload", "extended"], ["sidecar-previous", "sidecar"], seeds=20)
    by = {(r.workload, r.policy): r for r in results}
    # The old rule saved for the local write only: the 5 min upload, streamed from the
    # save's start, never ended in time (a 3 min one now often does: upload-3min).
    assert by[("heavy-upload", "sidecar-previous")].misses == 20
    assert by[("heavy-upload", "sidecar")].misses == 0
    # Exiting after the final save idled through the extension; waiting resumes training.
    assert by[("extended", "sidecar-previous")].idle_mean_seconds > 15 * 60
    assert by[("extended", "sidecar")].idle_mean_seconds < 60


# Seeds on which a periodic save made before the deadline was known used to count as
# the final save: the policy stopped at the notice and lost the 40-60 s trained since.
@pytest.mark.parametrize(
    ("workload", "seed"),
    [("brought-forward", 97), ("spot-notice-120s", 2), ("spot-notice-120s", 107),
     ("spot-notice-120s", 114)],
)
def test_periodic_save_before_the_notice_is_not_the_final_save(workload: str, seed: int) -> None:
    outcome = simulate_run(WORKLOADS[workload], CLASSIC, seed)
    assert outcome.feasible
    assert (outcome.missed, outcome.unsaved_seconds, outcome.interrupted_save) == (False, 0.0,
                                                                                  False)


def periodic_then_notice(notice_at_seconds: float) -> Workload:
    """20 s steps and 10 s saves, exactly; a notice at ``notice_at_seconds``, 150 s ahead."""
    return Workload(
        "periodic-then-notice",
        "20 s steps, 10 s saves, a notice 150 s ahead",
        lambda rng: (DeadlineChange(0.0, None),
                     DeadlineChange(notice_at_seconds, notice_at_seconds + 150.0)),
        step_seconds=20.0,
        step_jitter=0.0,
        save_seconds=10.0,
        save_jitter=0.0,
    )


def test_worked_example_periodic_save_then_notice() -> None:
    # The periodic save runs 1800-1810 s with no deadline known. The notice (deadline
    # 1970 s) reaches the job at 1850 s, after 40 s of training: within one budget of
    # the periodic save (1800 + 200 s), but that save was not made for it. Save again.
    outcome = simulate_run(periodic_then_notice(1820.0), CLASSIC, 0)
    assert (outcome.saves, outcome.unsaved_seconds, outcome.missed) == (2, 0.0, False)
    assert outcome.idle_seconds == pytest.approx(1970.0 - 1860.0)  # saved 1850-1860, waited
    assert outcome.lost_seconds == pytest.approx(1970.0 - 1850.0)  # resumes from 1850 s


def test_worked_example_notice_learned_during_the_periodic_save() -> None:
    # The notice reaches the job at 1805 s, during the periodic save: with nothing
    # trained since, that save is as fresh as a new one. Stop; no second save.
    outcome = simulate_run(periodic_then_notice(1775.0), CLASSIC, 0)
    assert (outcome.saves, outcome.unsaved_seconds, outcome.missed) == (1, 0.0, False)
    assert outcome.idle_seconds == pytest.approx(1925.0 - 1810.0)


def test_worked_example_top_up_after_the_final_save() -> None:
    # The same job with the top-up: the final save at 1850-1860 s leaves 110 s; a step,
    # a save (10 x 1.2) and the 5 s margin fit (37 s), so it trains until the next step
    # would not fit, and saves once more: at 1940 s (30 s left <= 37 s).
    top_up = PolicyFactory("top-up", "sidecar+periodic-30",
                           lambda run: SidecarWithPeriodicPolicy(30 * 60.0, top_up_seconds=5.0))
    outcome = simulate_run(periodic_then_notice(1820.0), top_up, 0)
    assert (outcome.saves, outcome.unsaved_seconds, outcome.missed) == (3, 0.0, False)
    assert outcome.lost_seconds == pytest.approx(1970.0 - 1940.0)
    assert outcome.idle_seconds == pytest.approx(1970.0 - 1950.0)


def test_sidecar_drives_the_real_guard_and_save_policy() -> None:
    agent = POLICIES["sidecar"].make(RunInfo(WORKLOADS["steady"].trace(0), 1000.0))
    assert isinstance(agent, SidecarPolicy)
    assert type(agent.policy) is SavePolicy and agent.policy.top_up_seconds == 5.0
    assert agent.waits and agent.uploads


def test_verl_saves_again_and_again_inside_the_window_where_ours_saves_at_most_twice() -> None:
    steady = WORKLOADS["steady"]
    for seed in range(20):
        verl = simulate_run(steady, POLICIES["verl"], seed)
        ours = simulate_run(steady, POLICIES["sidecar"], seed)
        assert verl.window_saves >= 2, verl
        assert ours.window_saves == 2 and ours.saves == 2, ours  # the final and the top-up
        assert ours.lost_seconds <= verl.lost_seconds, (ours, verl)
        assert ours.saving_seconds < verl.saving_seconds  # verl's last save is cut


def test_oracle_saves_once_as_late_as_the_save_and_upload_allow() -> None:
    for name in ("steady", "upload-1min"):
        workload = WORKLOADS[name]
        for seed in range(10):
            outcome = simulate_run(workload, POLICIES["oracle"], seed)
            trace = workload.trace(seed)
            # The upload streams while the save writes it: the longer, then the commit.
            durable = trace.save_seconds(0)
            if trace.upload_seconds(0):
                durable = max(durable, trace.upload_seconds(0)) + COMMIT_TAIL_SECONDS
            assert outcome.saves == 1 and not outcome.missed
            assert durable <= outcome.lost_seconds < durable + workload.step_max_seconds


@pytest.mark.parametrize("name", ["heavy-saves", "heavy-upload", "link-halves"])
def test_worst_case_saves_once_as_late_as_the_workloads_limits_allow(name: str) -> None:
    workload = get_workload(name)
    worst = workload.durable_max_seconds  # streamed: the longer of save and upload + tail
    if workload.upload_seconds:
        assert worst == max(workload.save_max_seconds,
                            workload.upload_max_seconds) + COMMIT_TAIL_SECONDS
    for seed in range(8):
        outcome = simulate_run(workload, POLICIES["worst-case"], seed)
        assert outcome.saves == 1 and not outcome.missed
        # The last step from which the longest step, save and upload still end in time:
        # never later than the limits allow, never more than one longest step earlier.
        assert worst <= outcome.lost_seconds < worst + workload.step_max_seconds


@pytest.mark.parametrize("name", ["heavy-brought-forward", "spot-notice-120s"])
def test_worst_case_misses_no_feasible_deadline_learned_late(name: str) -> None:
    # The deadline moves or comes with a notice: the save is for the deadline learned then.
    (result,) = run([name], ["worst-case"], seeds=30)
    assert result.feasible_runs > 0 and result.misses == 0


def test_worst_case_waits_for_a_deadline_and_stops_after_its_save() -> None:
    workload = get_workload("heavy-upload")
    policy = WorstCasePolicy(RunInfo(workload.trace(0), reclaim_seconds=5000.0))
    worst = workload.step_max_seconds + workload.durable_max_seconds
    assert not policy.should_save(4000.0, None)
    assert not policy.should_save(5000.0 - worst - 0.5, 5000.0)
    assert policy.should_save(5000.0 - worst + 0.5, 5000.0)
    assert not policy.should_stop(5000.0 - worst + 0.5, 5000.0)
    policy.record_save(45.0, 5000.0 - worst + 0.5)
    assert not policy.should_save(4990.0, 5000.0) and policy.should_stop(4990.0, 5000.0)


def test_uploader_finishes_the_final_checkpoint_before_a_top_up() -> None:
    # The final checkpoint (saved 40-100 s, 150 s upload streamed from 40 s) is still
    # uploading when the top-up lands at 130 s (60 left, 72 s with the margin; the top-up
    # 72 s); the release is at 300 s: both fit, one after the other.
    tail = COMMIT_TAIL_SECONDS
    final, top_up = Checkpoint(40.0, 100.0, 150.0), Checkpoint(110.0, 130.0, 60.0)
    both = [190.0 + tail, 190.0 + tail + 60.0 + tail]
    assert durable_times([final, top_up], lambda now: 300.0, 60.0) == both
    # With the release at 230 s they do not both fit: the newer one goes first (the
    # policy never makes such a top-up; a routine upload meeting the final one does).
    times = durable_times([final, top_up], lambda now: 230.0, 60.0)
    assert times == [math.inf, 130.0 + 60.0 + tail]
    # Far from the release the running upload always finishes first.
    assert durable_times([final, top_up], lambda now: 5000.0, 60.0) == both
    # A newer checkpoint arriving while one waits replaces it.
    third = Checkpoint(135.0, 150.0, 60.0)
    assert durable_times([final, top_up, third], lambda now: None, 60.0) == [
        both[0], math.inf, both[1]]


def test_worked_example_through_the_engine() -> None:
    exact = Workload(
        "worked-example",
        "80 s steps, 60 s saves, release 200 s after step 10",
        lambda rng: (DeadlineChange(0.0, 10 * 80.0 + 200.0),),
        step_seconds=80.0,
        step_jitter=0.0,
        save_seconds=60.0,
        save_jitter=0.0,
    )
    outcome = simulate_run(exact, POLICIES["sidecar"], seed=0)
    # After step 9, 280 s > 260 s budget; after step 10, 200 s left: save. 140 s left:
    # a top-up needs 80 + 72 + 5 s: wait for the release.
    counts = (outcome.steps, outcome.saves, outcome.unsaved_seconds, outcome.missed)
    assert counts == (10, 1, 0.0, False)
    assert outcome.idle_seconds == pytest.approx(140.0)
    assert outcome.lost_seconds == pytest.approx(200.0)


def test_verl_never_saves_for_esi_when_save_freq_is_not_positive() -> None:
    verl = VerlPolicy(redundant_seconds=120.0, save_freq=-1)
    for step in range(5):
        verl.record_step(20.0)
        assert not verl.should_save(100.0 * step, 100.0 * step + 50.0)
        verl.should_stop(100.0 * step, None)
    assert verl.close_to_expiration(0.0, 50.0)  # inside the window: only the gate said no


def test_periodic_30_loses_up_to_its_interval_on_steady_work() -> None:
    steady = WORKLOADS["steady"]
    (result,) = run([steady], ["periodic-30"], seeds=100)
    interval = 30 * 60 + steady.step_max_seconds + 2 * steady.save_max_seconds
    assert result.lost_max_seconds <= interval
    assert result.lost_max_seconds > 25 * 60
    assert 10 * 60 < result.lost_mean_seconds < 20 * 60
    assert result.misses > result.runs // 2  # its last save is rarely in the final window


def test_short_lead_notice_is_infeasible_and_not_a_policy_miss() -> None:
    results = run(["spot-notice-30s"], ["sidecar", "verl"], seeds=20)
    for result in results:
        assert result.feasible_runs == 0
        assert result.misses == 0
        assert result.infeasible_misses == result.runs
    assert INFEASIBLE == "lead time < step + save and its upload"  # streamed: the longer
    assert INFEASIBLE in render_table(results)
    (feasible,) = run(["spot-notice-120s"], ["sidecar"], seeds=20)
    assert feasible.feasible_runs == feasible.runs and feasible.misses == 0


def test_stress_workloads_have_the_documented_remedies() -> None:
    # A save never measured is assumed to take 60 s: periodic saves inside the guard teach
    # the policy the real time. A spike rarer than the window: a longer window keeps it.
    (slow,) = run(["very-slow-saves"], ["sidecar+periodic-30"], seeds=30)
    assert slow.misses == 0
    long_window = PolicyFactory("sidecar-w1000", "window of 1000 steps",
                                lambda run: SidecarPolicy(window=1000))
    (rare,) = run(["rare-validation"], [long_window], seeds=SEEDS)
    assert rare.misses == 0


def test_same_seed_same_results() -> None:
    first = run(["stragglers", "extended-then-back"], ["verl", "sidecar"], seeds=10, seed0=7)
    again = run(["stragglers", "extended-then-back"], ["verl", "sidecar"], seeds=10, seed0=7)
    other = run(["stragglers", "extended-then-back"], ["verl", "sidecar"], seeds=10, seed0=8)
    assert first == again
    assert first != other


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="esi-sidecar")
    add_simulate_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["simulate", *argv])
    code: int = args.func(args)
    return code


def test_cli_writes_markdown_csv_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = simulation_report.main(["--seeds", "3", "--workload", "steady",
                                   "--workload", "spot-notice-30s", "--policy", "sidecar",
                                   "--policy", "verl", "--out", str(tmp_path)])
    assert code == 0
    doc = (tmp_path / "simulation.md").read_text()
    assert "![" in doc and "(simulation.png)" in doc and "| steady | sidecar |" in doc
    assert (tmp_path / "simulation.png").read_bytes().startswith(b"\x89PNG")
    with (tmp_path / "simulation.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {(row["workload"], row["policy"]) for row in rows} == {
        ("steady", "sidecar"), ("steady", "verl"),
        ("spot-notice-30s", "sidecar"), ("spot-notice-30s", "verl"),
    }
    # Off a terminal, progress is a line per workload on stderr (issue 26), nothing redrawn.
    err = capsys.readouterr().err
    assert err.startswith("simulating 2 workloads x 2 policies x 3 seeds, about 1 s ...\n"), err
    assert "\r" not in err


def test_cli_no_plot_and_stdout_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert simulation_report.main(["--seeds", "2", "--workload", "steady",
                                   "--out", str(tmp_path), "--no-plot"]) == 0
    assert not (tmp_path / "simulation.png").exists()
    assert "simulation.png" not in (tmp_path / "simulation.md").read_text()
    capsys.readouterr()
    assert _cli("--seeds", "2", "--workload", "steady", "--policy", "periodic-15") == 0
    out = capsys.readouterr().out
    assert out.startswith("| workload | policy |") and "| steady | periodic-15 |" in out


def test_cli_out_writes_the_csv_and_plot_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 38, item 4: docs/simulation.md is the repository script's; the command's --out
    writes what the wheel can: the CSV and the plot."""
    assert _cli("--seeds", "2", "--workload", "steady", "--policy", "sidecar",
                "--out", str(tmp_path)) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["simulation.csv", "simulation.png"]
    assert capsys.readouterr().out.split() == [str(tmp_path / "simulation.csv"),
                                               str(tmp_path / "simulation.png")]
    # Its help says so and where the document comes from; the document's options are the
    # script's.
    with pytest.raises(SystemExit) as exc:
        _cli("--help")
    assert exc.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "python tools/simulation_report.py --out docs/" in help_text
    assert "simulation.csv and simulation.png into DIR, not simulation.md" in help_text
    with pytest.raises(SystemExit) as exc:
        _cli("--out", str(tmp_path), "--top-up-sweep")
    assert exc.value.code == 2


def test_cli_list_names_every_workload_and_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli("--list") == 0
    out = capsys.readouterr().out
    for name in [*WORKLOADS, *POLICIES]:
        assert f"  {name} " in out


def test_cli_rejects_unknown_names() -> None:
    with pytest.raises(SystemExit) as exc:
        _cli("--workload", "nope")
    assert exc.value.code == 2


def test_cli_says_how_far_it_is_on_stderr_as_each_workload_is_done() -> None:
    """`esi-sidecar simulate` ran 60 s printing nothing (issue 26): a real process whose
    stderr is a pipe gets a line at once and one per workload; stdout has the table only."""
    process = subprocess.Popen(
        [sys.executable, "-m", "sidecar.cli", "simulate", "--seeds", "2",
         "--workload", "steady", "--workload", "spot-notice-30s", "--policy", "sidecar"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    try:
        first = process.stderr.readline()  # before the simulation ends
        assert first == "simulating 2 workloads x 1 policies x 2 seeds, about 1 s ...\n"
        out, rest = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert process.returncode == 0, rest
    lines = rest.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["  steady done", "  spot-notice-30s done"]
    assert lines[1].startswith("  spot-notice-30s done (2/2, ") and lines[1].endswith(" s)")
    assert out.startswith("|") and "| steady | sidecar |" in out and "done" not in out


def test_no_miss_on_the_heavy_workloads_and_the_chosen_margin_loses_less() -> None:
    # Issue 23: saves of 150-240 s, or uploads of 5 min, measured before the run.
    from sidecar.tools.simulate.workloads import HEAVY_WORKLOADS

    results = run(list(HEAVY_WORKLOADS), ["sidecar", "sidecar-auto-margin", "sidecar-previous"],
                  seeds=10)
    by = {(r.workload, r.policy): r for r in results}
    for name in HEAVY_WORKLOADS:
        assert by[(name, "sidecar")].misses == 0, by[(name, "sidecar")]
    for name in ("heavy-saves", "heavy-upload"):
        auto, fixed = by[(name, "sidecar-auto-margin")], by[(name, "sidecar")]
        assert auto.misses == 0 and auto.lost_median_seconds < fixed.lost_median_seconds
    assert by[("heavy-upload", "sidecar-previous")].misses == 10  # the upload not budgeted


def test_cli_runs_a_heavy_workload_and_lists_them(capsys: pytest.CaptureFixture[str]) -> None:
    from sidecar.tools.simulate.workloads import HEAVY_WORKLOADS

    assert _cli("--seeds", "1", "--workload", "heavy-saves", "--policy", "sidecar") == 0
    assert "| heavy-saves | sidecar |" in capsys.readouterr().out
    assert _cli("--list") == 0
    out = capsys.readouterr().out
    for name in HEAVY_WORKLOADS:
        assert f"  {name} " in out


def test_a_plain_simulate_is_a_quick_look_and_says_how_long(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 39, item 10: the default ran 200 seeds (about 17 min); now a few, with the time
    it will take on stderr before it starts, and the report's 200 stay with --out."""
    from sidecar.cli import build_parser, main
    from sidecar.tools.simulate.command import QUICK_SEEDS, REPORT_SEEDS

    assert QUICK_SEEDS <= 10 and REPORT_SEEDS == 200
    assert main(["simulate", "--workload", "steady", "--policy", "oracle"]) == 0
    out, err = capsys.readouterr()
    first = err.splitlines()[0]
    assert f"x {QUICK_SEEDS} seeds, about " in first and "--seeds 200" in first
    (row,) = [line for line in out.splitlines() if line.startswith("| steady | oracle |")]
    assert f"/{QUICK_SEEDS} |" in row
    assert build_parser().parse_args(["simulate"]).seeds is None  # resolved by --out or not
