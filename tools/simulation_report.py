"""Writes docs/simulation.md, simulation.csv and simulation.png (not in the wheel).

    python tools/simulation_report.py --out docs/      # 200 seeds: the report's numbers
    python tools/simulation_report.py --seeds 3 --workload steady --out /tmp/sim

The whole document is rendered here (text, tables and headline), so that re-running it
keeps prose and numbers in step; simulation_heavy.py appends the "Heavy checkpoints"
section. The engine, the policies, the workloads, the table, the CSV and the plot are the
``esi-sidecar simulate`` command's (``sidecar/tools/simulate/``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from simulation_heavy import HEAVY_SECTION_WORKLOADS, run_heavy, write_heavy_section

from sidecar.tools.simulate.command import (
    REPORT_SEEDS,
    add_run_arguments,
    matplotlib_missing,
    progress,
    run_selected,
)
from sidecar.tools.simulate.engine import (
    COMMIT_TAIL_SECONDS,
    WINDOW_MARGIN_SECONDS,
    Result,
    top_up_sweep,
)
from sidecar.tools.simulate.policies import POLICIES
from sidecar.tools.simulate.table import (
    INFEASIBLE,
    PLOT_POLICIES,
    feasible_text,
    is_stress,
    minutes,
    misses_text,
    render_table,
    targets,
    write_results,
)
from sidecar.tools.simulate.workloads import WORKLOADS
from sidecar.train.policy import DEFAULT_TOP_UP_SECONDS

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _saves(count: int) -> str:
    return f"{count} save" + ("" if count == 1 else "s")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def render_summary(results: Sequence[Result]) -> str:
    """Per policy, over all workloads in the run: misses split reference / stress."""
    lines = [
        "| policy | missed / feasible runs (reference workloads) "
        "| missed / feasible runs (stress workloads) | infeasible runs "
        "| median lost min per reclaim (reference, mean over workloads) "
        "| idle min per reclaim (reference) | saves in final window (reference, mean / max) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for policy in dict.fromkeys(r.policy for r in results):
        mine = [r for r in results if r.policy == policy]
        ref = [r for r in mine if not is_stress(r.workload)]
        stress = [r for r in mine if is_stress(r.workload)]
        feasible = [r for r in ref if r.feasible_runs]
        lost = _mean([r.lost_median_seconds for r in feasible])
        idle = _mean([r.idle_mean_seconds for r in feasible])
        window = _mean([r.window_saves_mean for r in feasible])
        window_max = max((r.window_saves_max for r in feasible), default=0)

        def tally(rows: list[Result]) -> str:
            if not rows:
                return "-"
            return f"{sum(r.misses for r in rows)} / {sum(r.feasible_runs for r in rows)}"

        lines.append(
            f"| {policy} | {tally(ref)} | {tally(stress)} "
            f"| {sum(r.infeasible_runs for r in mine)} | {minutes(lost)} | {minutes(idle)} "
            f"| {window:.2f} / {window_max} |"
        )
    return "\n".join(lines) + "\n"


def render_targets(results: Sequence[Result], policy: str = "sidecar") -> str:
    rows = targets(results, policy)
    if not rows:
        return ""
    lines = [
        f"| workload | oracle median lost s | limit s (oracle x 1.1 + one step) "
        f"| {policy} median lost s | {policy} missed | {policy} saves per deadline (max) "
        "| met |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for t in rows:
        lines.append(
            f"| {t.workload} | {t.oracle_seconds:.0f} | {t.limit_seconds:.0f} "
            f"| {t.policy_seconds:.0f} | {t.misses} | {t.window_saves_max} "
            f"| {'yes' if t.met else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


def _no_top_up_text(results: Sequence[Result], policy: str = "sidecar") -> str:
    """Why some rows have one save per deadline: no top-up fitted there."""
    single = [t.workload for t in targets(results, policy) if t.window_saves_max < 2]
    if not single:
        return ""
    missed = [t.workload for t in targets(results, policy) if not t.met]
    return (
        f"No top-up fits after the final save on {', '.join(single)}: the sidecar makes its "
        "one final save there, loses the margin as before, and misses nothing. A top-up "
        "needs a typical step, a save and its upload to fit in what is left after the final "
        "save; that fails when the save takes longer than assumed (`slow-saves`: 150 s "
        "against the 60 s assumed before any save was measured), when the daemon's "
        "estimate, asked right after the final save, counts the final checkpoint whole "
        "while its upload still runs (`upload-1min`, `upload-3min`: streamed, it is "
        "durable a few seconds to two minutes after its save, but the estimate is its whole "
        "upload x1.2 until then, and the uploader finishes it before a top-up so that the "
        "final checkpoint is never put at risk for one), or when the notice comes too late "
        "(`spot-notice-120s`). "
        + (f"The target is then missed on {', '.join(missed)}: the one safe save comes "
           "earlier than the oracle's perfectly timed one by more than a step and 10 %, "
           "and no second save fits; only a policy that gives up the final save's margin "
           "could meet it there." if missed else "")
        + "\n"
    )


def render_short_notices(results: Sequence[Result]) -> str:
    """The spot-notice workloads under ``sidecar-no-late``, the sidecar and
    ``sidecar-try-late``: a save that the estimate says cannot end in time, skipped, tried
    when its expected time fits, or always tried."""
    pairs = ("sidecar-no-late", "sidecar", "sidecar-try-late")
    rows = [r for r in results if r.workload.startswith("spot-notice") and r.policy in pairs]
    if not rows:
        return "(run the spot-notice workloads with `sidecar-no-late`, `sidecar` and " \
               "`sidecar-try-late`)\n"
    lines = [
        "| notice | policy | feasible runs | missed | median lost min | saves | cut by reclaim |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.workload} | {r.policy} | {feasible_text(r)} | {misses_text(r)} "
            f"| {minutes(r.lost_median_seconds)} | {r.saves_mean:.2f} | {r.interrupted_saves} |"
        )
    return "\n".join(lines) + "\n"


def render_sweep(sweep: Sequence[Result]) -> str:
    """One row per top-up margin: misses, saves, the target met on how many workloads,
    and the median loss per workload."""
    if not sweep:
        return ""
    workloads = list(dict.fromkeys(r.workload for r in sweep
                                   if r.policy != "oracle" and r.feasible_runs))
    margins = list(dict.fromkeys(r.policy for r in sweep if r.policy != "oracle"))
    by_key = {(r.workload, r.policy): r for r in sweep}
    head = " | ".join(workloads)
    lines = [
        f"| policy | missed | saves per deadline (max) | target met | {head} |",
        "|---|---:|---:|---:|" + "---:|" * len(workloads),
    ]
    for name in margins:
        mine = [by_key[(w, name)] for w in workloads if (w, name) in by_key]
        met = targets(sweep, name)
        cells = " | ".join(f"{by_key[(w, name)].lost_median_seconds:.0f}" for w in workloads)
        lines.append(
            f"| {name} | {sum(r.misses for r in mine)} "
            f"| {max(r.window_saves_max for r in mine)} "
            f"| {sum(t.met for t in met)} / {len(met)} | {cells} |"
        )
    if any(r.policy == "oracle" for r in sweep):
        cells = " | ".join(f"{by_key[(w, 'oracle')].lost_median_seconds:.0f}"
                           for w in workloads)
        lines.append(f"| oracle | - | 1 | - | {cells} |")
    return "\n".join(lines) + "\n" + _sweep_reading(sweep, margins)


def _sweep_reading(sweep: Sequence[Result], margins: Sequence[str]) -> str:
    """Per margin, the workloads with a top-up on which the target is missed."""
    topped = {r.workload for r in sweep if r.window_saves_max >= 2 and r.feasible_runs}
    parts = []
    for name in margins:
        missed = [t.workload for t in targets(sweep, name) if not t.met and t.workload in topped]
        label = name.rsplit("-", 1)[-1]
        label = "no top-up" if label == "none" else f"{label} s"
        text = ("none" if not missed else "all of them" if len(missed) == len(topped)
                else ", ".join(missed))
        parts.append(f"{label}: {text}")
    return ("\nTarget missed, among the workloads where a top-up fits ("
            + ", ".join(sorted(topped)) + "): " + "; ".join(parts) + ".\n")


def headline(results: Sequence[Result]) -> list[str]:
    """The sentences at the top of the doc, computed from whichever policies ran."""
    lines = []
    # This project's policy first, its variants, verl's, the rest, the oracle last.
    order = sorted(dict.fromkeys(r.policy for r in results),
                   key=lambda name: (name != "sidecar", not name.startswith("sidecar"),
                                     not name.startswith("verl"), name == "oracle"))
    for policy in order:
        mine = [r for r in results if r.policy == policy and r.feasible_runs]
        ref = [r for r in mine if not is_stress(r.workload)]
        parts = []
        if ref:
            text = (
                f"{sum(r.misses for r in ref)} missed deadlines across "
                f"{sum(r.feasible_runs for r in ref)} feasible runs of the reference workloads"
            )
            worst = max(ref, key=lambda r: r.misses / r.feasible_runs)
            if worst.misses:
                text += f" (worst: {worst.misses}/{worst.feasible_runs} on {worst.workload})"
            parts.append(text)
            parts.append(
                f"{minutes(_mean([r.lost_median_seconds for r in ref]))} min lost per reclaim "
                f"(median), {minutes(_mean([r.idle_mean_seconds for r in ref]))} min idle, "
                f"up to {_saves(max(r.window_saves_max for r in ref))} per deadline"
            )
        stress = [r for r in mine if is_stress(r.workload)]
        if stress:
            parts.append("stress: " + ", ".join(
                f"{r.misses}/{r.feasible_runs} missed on {r.workload}" for r in stress
            ))
        lines.append(f"- **{policy}**: " + "; ".join(parts) + ".")
    return lines


def render_document(
    results: Sequence[Result],
    *,
    seeds: int,
    notice_delay_seconds: float,
    plot_name: str | None,
    sweep: Sequence[Result] = (),
) -> str:
    """The whole docs/simulation.md."""
    workloads = list(dict.fromkeys(r.workload for r in results))
    policies = list(dict.fromkeys(r.policy for r in results))
    workload_rows = "\n".join(
        f"| {w.name} | {w.description} | {w.step_max_seconds:.0f} | {w.save_max_seconds:.0f} "
        f"| {w.upload_max_seconds:.0f} | {w.durable_max_seconds:.0f} | {w.stress or '-'} |"
        for w in (WORKLOADS[n] for n in workloads if n in WORKLOADS)
    )
    policy_rows = "\n".join(
        f"| {p.name} | {p.description} |" for p in (POLICIES[n] for n in policies if n in POLICIES)
    )
    plot = (f"![lost minutes per reclaim by workload and policy]({plot_name})\n\n"
            f"The plot shows {', '.join(PLOT_POLICIES)} where they were run; the tables "
            "below have every policy.\n" if plot_name else "")
    target_rows = render_targets(results)
    no_top_up = _no_top_up_text(results)
    sweep_rows = render_sweep(sweep)
    return _TEMPLATE.format(
        seeds=seeds,
        delay=f"{notice_delay_seconds:g}",
        margin=f"{WINDOW_MARGIN_SECONDS:g}",
        tail=f"{COMMIT_TAIL_SECONDS:g}",
        top_up=f"{DEFAULT_TOP_UP_SECONDS:g}",
        headline="\n".join(headline(results)),
        workloads=workload_rows,
        policies=policy_rows,
        summary=render_summary(results),
        no_top_up=no_top_up,
        targets=target_rows or "(run the `sidecar` and `oracle` policies to see it)\n",
        sweep=sweep_rows or "(run with `--top-up-sweep` to see it)\n",
        short=render_short_notices(results),
        table=render_table(results),
        plot=plot,
    )


def write_outputs(
    results: Sequence[Result],
    out: Path,
    *,
    seeds: int,
    notice_delay_seconds: float,
    plot: bool = True,
    sweep: Sequence[Result] = (),
) -> list[Path]:
    """Write simulation.md, simulation.csv and (with ``plot``) simulation.png into ``out``."""
    written = [out / "simulation.md", *write_results(results, out, plot=plot)]
    written[0].write_text(
        render_document(
            results,
            seeds=seeds,
            notice_delay_seconds=notice_delay_seconds,
            plot_name="simulation.png" if plot else None,
            sweep=sweep,
        )
    )
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python tools/simulation_report.py",
        description="Run the simulator for docs/simulation.md and write it with its CSV and "
        "plot: the main runs, the top-up sweep and the heavy checkpoints' section.",
    )
    add_run_arguments(parser, seeds_help=f"runs per workload and policy (default "
                      f"{REPORT_SEEDS})")
    parser.add_argument("--out", type=Path, default=DOCS, metavar="DIR",
                        help="write simulation.md/.csv/.png into DIR (default: docs/)")
    parser.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True,
                        help="draw simulation.png (default: yes)")
    parser.add_argument("--top-up-sweep", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the sidecar with several top-up margins, the runs "
                        "behind the default (default: yes)")
    args = parser.parse_args(argv)
    if args.plot and matplotlib_missing(parser.prog):
        return 2
    if args.seeds is None:
        args.seeds = REPORT_SEEDS
    results = run_selected(args, quick=False)
    sweep = []
    if args.top_up_sweep:
        sweep = top_up_sweep(args.seeds, args.seed0, notice_delay_seconds=args.notice_delay,
                             progress=progress(f"top-up margins x {args.seeds} seeds",
                                               [w.name for w in WORKLOADS.values()
                                                if not w.stress]))
    heavy = run_heavy(args.seeds, args.seed0, notice_delay_seconds=args.notice_delay,
                      progress=progress(f"heavy checkpoints x {args.seeds} seeds",
                                        list(HEAVY_SECTION_WORKLOADS)))
    written = write_outputs(results, args.out, seeds=args.seeds,
                            notice_delay_seconds=args.notice_delay, plot=args.plot, sweep=sweep)
    write_heavy_section(written[0], heavy, args.seeds)
    for path in written:
        print(path)
    return 0


_TEMPLATE = """\
# Simulation: saving before the release, policy by policy

Generated by `python tools/simulation_report.py --out docs/` ({seeds} seeds per workload
and policy, notice delay {delay} s). Do not edit by hand: change `sidecar/tools/simulate/`
or the script and re-run. (`esi-sidecar simulate --out DIR` writes the CSV and the plot
only.)

## Headline

{headline}

{summary}
## The top-up target

The guard's final save keeps a 120 s margin; the top-up save after it wins most of that
margin back. Target: on every reference workload, no missed deadline, at most two saves
per deadline, and a median loss per reclaim within the oracle's (one perfectly timed
save) + one step + 10 % of the oracle's.

{targets}
{no_top_up}
## Choosing the top-up margin

`SavePolicy(top_up_seconds=...)`, the margin the top-up keeps before the release on top
of the x1.2 on measured saves and uploads. The same runs for each margin on the
reference workloads where a deadline is feasible (median GPU seconds lost per reclaim):

{sweep}
The default is **{top_up} s**, the largest margin that met the target on every workload
where a top-up fits. No margin produced a miss here: a top-up cut by the release (a
straggler step after all, a slow save) loses only the steps trained since the final
save, which is durable. A margin above zero keeps a few seconds for what the simulator
does not model (the daemon's poll, clocks); `top_up_seconds=None` turns the top-up off.

## Short notices

A spot notice of 30 s, or a SIGTERM's grace period, is shorter than the rule's budget,
and often shorter than a save. The rule then saves at once if the save (and its upload)
is expected to end before the deadline. When only its padded estimate says it would not,
the default (`SavePolicy(try_late_saves="auto")`) still starts it where the deadline is
the machine's end (a reclaim notice or a release, served by the daemon: the process goes
with the machine either way) and the expected time, without the x1.2, fits; before the
process's own end (a SIGTERM grace, a Slurm time limit) it starts none, as
`sidecar-no-late` (`try_late_saves=False`) here: training goes on, in case the deadline
moves, and the job can still leave cleanly (exit 75, what its scheduler reads) instead of
being killed mid-save. `sidecar-try-late` always starts it. Every simulated notice is the
machine's. The notice reaches the job within 2 s here (the aws source polls IMDS every
2 s):

{short}
A tried save only helps when it ends in time although the estimate (the largest recent
save x 1.2, or the assumed 60 s before any was measured) said it would not; the rest
are cut by the reclaim. On the notices that leave room for a save (120 s, 300 s) the
three choices are the same run.

## The model

A trace-driven, discrete-event simulation (no sleeping): time advances by drawn
durations, so thousands of two-hour runs take seconds.

- The job runs training steps back to back; durations are drawn from the workload.
  After every step the policy is asked whether to save; a save blocks training for a
  drawn duration. The run starts from a durable checkpoint (a resumed job).
- **Durability.** The machine's local disk goes with it. Without an uploader a local
  save is durable at once; with one (`upload-*` workloads) a checkpoint is durable when
  its commit ends. The uploader is the daemon's, and **streams**: its one thread sends a
  save's files while the save writes them, so with the thread free a checkpoint is
  durable at max(save end, stream start + upload) + the commit's tail ({tail} s: the last
  file, the manifest). The thread is not free while an older checkpoint uploads or
  waits: the save's stream starts when that one is durable, and a checkpoint saved while
  one uploads waits for it (newest first: an older one waiting is skipped), except near
  the release (within 600 s, or twice the estimate), where the running upload gives way
  to it unless both still end before the known deadline (`plan.gives_way`). The
  policies are told the uploader's estimate as `/v1/expiry` serves it, computed by the
  daemon's own code (`plan.estimate_seconds`): the largest of the newest 3 checkpoints'
  bytes left after their save (a checkpoint not yet durable counts whole) at the
  slow-tail rate x 1.2, never less than their measured times from the commit's start to
  durable x 1.2 (docs/upload.md), with the count of uploads it rests on: the guard keeps
  the estimate its checkpoint carried (the uploader's before the run, which streamed its
  uploads too) as a floor until 10 uploads were measured.
- The machine is reclaimed when the true deadline is reached. The deadline may move
  mid-run; the job learns of a move **{delay} s** after it happened (the daemon serves it
  after its next poll; 2 s on the spot-notice workloads, the aws source's poll). A
  deadline known before the run is known at once.
- A save still in progress at the reclaim is lost, and so is an upload.
- **Stop and wait.** A policy that stops either ends the job (the machine then idles:
  periodic saving never stops, `verl` never stops, `sidecar-previous` and `oracle` do) or
  waits, as `CheckpointGuard.should_stop()` does by default: it is asked again at each
  deadline change it learns of, and training resumes in the same process when the
  release moved later (a renewal), with the rule re-armed.
- Every policy meets the same trace for a seed: step *i*, save *k* and upload *k* take the
  same time and the deadline moves at the same instants (common random numbers; `random`
  seeded with `"<workload>/<seed>/..."`, so results are identical on every machine).

## Workloads

`step max`, `save max` and `upload max` are the largest durations the workload can
draw, `durable max` the longest from a save's start to durable (the upload streamed:
the longer of save max and upload max, then the commit's tail); step max and durable
max set feasibility and the final window. Stress workloads hide something from a
policy that only knows its own measurements; they are reported apart.

| workload | description | step max s | save max s | upload max s | durable max s | stress: hides |
|---|---|---:|---:|---:|---:|---|
{workloads}

## Policies

| policy | what it does |
|---|---|
{policies}

`verl` reproduces verl's trainer (`ray_trainer.py`, `should_save_ckpt_esi`): running max
of the whole step's wall time since the start (the `step` timer also encloses the save,
and the max is updated at the end of the step, so it is 0 on the first step), a fixed
60 s save estimate, and a save on **every** step for which `0 < remaining <= 60 +
max_step + esi_redundant_time`; all of it only when `save_freq > 0` (with verl's default
`save_freq: -1` the ESI trigger never fires). `save_freq` is set beyond the run length,
so only the ESI trigger is compared. `verl` uses `esi_redundant_time = 120 s`, the value
the ESI guide configures; `verl-r0` uses verl's own default, 0 s. verl knows nothing of
uploads.
The `sidecar*` policies are the real `sidecar.train.guard.CheckpointGuard` and
`sidecar.train.policy.SavePolicy` (not a copy) on the simulated clock:
`record_step` after each step, `should_save()`, `record_save` after each save,
`should_stop()`. `sidecar-previous` is the behaviour before durability was budgeted: no
upload in the budget, no top-up, the job exits after its final save.

## Metrics (per reclaim, over the seeds)

- **lead time**: reclaim time minus the time the job learned the deadline that was
  enforced (the whole run for a release known from the start).
- **feasible**: lead time >= step max + durable max: from the worst moment (a
  worst-case step just started) one more step, one save and its upload (streamed while
  the save writes) still fit. Where
  no run is feasible the table says "{infeasible}"; such runs are not counted as a
  policy's misses.
- **final window**: opens at the later of the moment the job learned the enforced
  deadline and `W` before the reclaim, `W = step max + durable max + {margin} s` (the
  seed rule's budget with the workload's worst step, save and upload, and the guide's
  margin).
- **missed**: at the reclaim, training was done since the newest *durable* checkpoint
  and that checkpoint's save ended before the final window opened.
- **lost min**: GPU time per reclaim after the training state the next machine resumes
  from (the start of the newest durable checkpoint's save) until the reclaim: the final
  save itself, steps to redo, idling. Per GPU: multiply by the job's GPU count. The
  oracle's is the least one save can do (the longer of its save and its upload, the
  commit, and less than a step).
- **saves**: completed saves per run. **saves in final window**: saves ending inside the
  final window, the one cut by the reclaim included (mean, and the most in any run).
  **cut by reclaim**: runs whose last save was in progress at the reclaim. **saving
  min**: time spent saving (cut save included). **idle min**: time neither training nor
  saving (after an exit, or waiting for the release).

## Results

{plot}
{table}
## Reading the results

- Periodic saving loses about half its interval per reclaim on average and up to a
  whole interval (plus a step and a save), whatever the deadline does.
- verl keeps saving on every step inside its window, each save adding to its running
  max and so widening the window; the last save is usually cut by the reclaim. It
  ignores uploads: with a 3 min upload every run misses. With `esi_redundant_time = 0`
  the save starts about one step + 60 s before the reclaim, and a longer save or any
  upload is lost.
- `sidecar-previous` saves once and exits: nothing lost on local disks, about 3 min of
  GPU time per reclaim (the margin), all of the extension idle when a release is moved
  later after its save (`extended`), and every run missed once the upload is longer
  than the margin (`upload-3min`): its final checkpoint was never durable.
- `sidecar` budgets the upload (0 misses with uploads), waits after the final save so a
  renewal resumes training (`extended`: no idle extension), and its top-up save wins the
  margin back where one fits (the target table above).
- A save covers deadlines (up to one budget after it started) only if it was made for
  one: the deadline was known when the save started and already inside the rule's
  window. A periodic save made before a notice or a brought-forward release arrived does
  not make the policy stop: the training done since gets its own final save.
- Short-lead notices: where the notice arrives too late for a step and a save, only a
  periodic save bounds the loss, hence `sidecar+periodic-30`.
- Stress workloads: a save never measured is assumed to take 60 s (`save_seconds`);
  configure it, or let the guard measure periodic saves (the guard's measurements also
  travel with the checkpoint, `CheckpointGuard.state_dict()`). A spike rarer than the
  step window (100 steps) is forgotten by the estimate; a longer `window` keeps it.
""".replace("{infeasible}", INFEASIBLE)


if __name__ == "__main__":
    sys.exit(main())
