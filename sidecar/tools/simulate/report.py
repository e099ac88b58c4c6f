"""Results as a markdown document, a CSV file and a PNG plot.

The whole of docs/simulation.md is rendered here (text, table and headline), so that
re-running ``esi-sidecar simulate --out docs`` keeps prose and numbers in step.
matplotlib is imported only by :func:`write_plot`: the core stays stdlib-only.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from sidecar.tools.simulate.engine import WINDOW_MARGIN_SECONDS, Result
from sidecar.tools.simulate.policies import POLICIES
from sidecar.tools.simulate.workloads import WORKLOADS

__all__ = ["render_document", "render_table", "write_csv", "write_outputs", "write_plot"]

INFEASIBLE = "lead time < step + save"


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f}"


def feasible_text(result: Result) -> str:
    text = f"{result.feasible_runs}/{result.runs}"
    return text if result.feasible_runs else f"{text}: {INFEASIBLE}"


def _misses_text(result: Result) -> str:
    if not result.feasible_runs:
        return f"({result.infeasible_misses} infeasible)"
    text = str(result.misses)
    return text + (f" (+{result.infeasible_misses} infeasible)" if result.infeasible_misses else "")


def render_table(results: Sequence[Result]) -> str:
    """One row per (workload, policy): the table printed by the CLI and kept in the doc."""
    lines = [
        "| workload | policy | feasible runs | missed | lost min (mean / p95 / max) "
        "| saves | saves in final window | cut by reclaim | saving min | idle min |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lost = (f"{_minutes(r.lost_mean_seconds)} / {_minutes(r.lost_p95_seconds)} / "
                f"{_minutes(r.lost_max_seconds)}")
        lines.append(
            f"| {r.workload} | {r.policy} | {feasible_text(r)} | {_misses_text(r)} | {lost} "
            f"| {r.saves_mean:.2f} | {r.window_saves_mean:.2f} | {r.interrupted_saves} "
            f"| {_minutes(r.saving_mean_seconds)} | {_minutes(r.idle_mean_seconds)} |"
        )
    return "\n".join(lines) + "\n"


def _is_stress(name: str) -> bool:
    workload = WORKLOADS.get(name)
    return workload is not None and bool(workload.stress)


def render_summary(results: Sequence[Result]) -> str:
    """Per policy, over all workloads in the run: misses split reference / stress."""
    lines = [
        "| policy | missed / feasible runs (reference workloads) "
        "| missed / feasible runs (stress workloads) | infeasible runs "
        "| mean lost min per reclaim (reference) | saves in final window (reference) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for policy in dict.fromkeys(r.policy for r in results):
        mine = [r for r in results if r.policy == policy]
        ref = [r for r in mine if not _is_stress(r.workload)]
        stress = [r for r in mine if _is_stress(r.workload)]
        feasible = [r for r in ref if r.feasible_runs]
        lost = sum(r.lost_mean_seconds for r in feasible) / len(feasible) if feasible else 0.0
        window = sum(r.window_saves_mean for r in feasible) / len(feasible) if feasible else 0.0

        def tally(rows: list[Result]) -> str:
            if not rows:
                return "-"
            return f"{sum(r.misses for r in rows)} / {sum(r.feasible_runs for r in rows)}"

        lines.append(
            f"| {policy} | {tally(ref)} | {tally(stress)} "
            f"| {sum(r.infeasible_runs for r in mine)} | {_minutes(lost)} | {window:.2f} |"
        )
    return "\n".join(lines) + "\n"


def headline(results: Sequence[Result]) -> list[str]:
    """The sentences at the top of the doc, computed from whichever policies ran."""
    lines = []
    # This project's policy first, then verl's, then the rest, as the doc is read.
    order = sorted(dict.fromkeys(r.policy for r in results),
                   key=lambda name: (not name.startswith("sidecar"), not name.startswith("verl")))
    for policy in order:
        mine = [r for r in results if r.policy == policy and r.feasible_runs]
        ref = [r for r in mine if not _is_stress(r.workload)]
        parts = []
        if ref:
            window = sum(r.window_saves_mean for r in ref) / len(ref)
            lost = sum(r.lost_mean_seconds for r in ref) / len(ref)
            text = (
                f"{sum(r.misses for r in ref)} missed deadlines across "
                f"{sum(r.feasible_runs for r in ref)} feasible runs of the reference workloads"
            )
            worst = max(ref, key=lambda r: r.misses / r.feasible_runs)
            if worst.misses:
                text += f" (worst: {worst.misses}/{worst.feasible_runs} on {worst.workload})"
            parts.append(text)
            parts.append(f"{window:.1f} saves in the final window and {_minutes(lost)} min "
                         "lost per reclaim on average")
        stress = [r for r in mine if _is_stress(r.workload)]
        if stress:
            parts.append("stress: " + ", ".join(
                f"{r.misses}/{r.feasible_runs} missed on {r.workload}" for r in stress
            ))
        lines.append(f"- **{policy}**: " + "; ".join(parts) + ".")
    return lines


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


def write_plot(results: Sequence[Result], path: Path) -> None:
    """Lost minutes per reclaim, one group of bars per workload; value and misses on bars.

    Horizontal bars on a symlog axis: losses span 0 (the sidecar) to hours (a lost
    final save), and every bar carries its number so a zero stays visible.
    """
    import matplotlib  # lazily: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in results))
    policies = list(dict.fromkeys(r.policy for r in results))
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
            value = result.lost_mean_seconds / 60
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
        [w + (" (stress)" if _is_stress(w) else "") for w in workloads], fontsize=9
    )
    ax.invert_yaxis()
    ax.set_xlabel("mean training minutes lost per reclaim (per GPU; symlog scale)")
    ax.set_title("Work lost at the reclaim, by workload and policy (text: missed deadlines)",
                 pad=22)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(policies), fontsize=8,
              frameon=False, handlelength=1.2, columnspacing=1.0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_document(
    results: Sequence[Result], *, seeds: int, notice_delay_seconds: float, plot_name: str | None
) -> str:
    """The whole docs/simulation.md."""
    workloads = list(dict.fromkeys(r.workload for r in results))
    policies = list(dict.fromkeys(r.policy for r in results))
    workload_rows = "\n".join(
        f"| {w.name} | {w.description} | {w.step_max_seconds:.0f} | {w.save_max_seconds:.0f} "
        f"| {w.stress or '-'} |"
        for w in (WORKLOADS[n] for n in workloads if n in WORKLOADS)
    )
    policy_rows = "\n".join(
        f"| {p.name} | {p.description} |" for p in (POLICIES[n] for n in policies if n in POLICIES)
    )
    plot = f"![lost minutes per reclaim by workload and policy]({plot_name})\n" if plot_name else ""
    return _TEMPLATE.format(
        seeds=seeds,
        delay=f"{notice_delay_seconds:g}",
        margin=f"{WINDOW_MARGIN_SECONDS:g}",
        headline="\n".join(headline(results)),
        workloads=workload_rows,
        policies=policy_rows,
        summary=render_summary(results),
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
) -> list[Path]:
    """Write simulation.md, simulation.csv and (with ``plot``) simulation.png into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "simulation.md", out / "simulation.csv"]
    if plot:
        write_plot(results, out / "simulation.png")
        written.append(out / "simulation.png")
    write_csv(results, out / "simulation.csv")
    written[0].write_text(
        render_document(
            results,
            seeds=seeds,
            notice_delay_seconds=notice_delay_seconds,
            plot_name="simulation.png" if plot else None,
        )
    )
    return written


_TEMPLATE = """\
# Simulation: saving before the release, policy by policy

Generated by `esi-sidecar simulate --out docs` ({seeds} seeds per workload and policy,
notice delay {delay} s). Do not edit by hand: change `sidecar/tools/simulate/` and re-run.

## Headline

{headline}

{summary}
## The model

A trace-driven, discrete-event simulation (no sleeping): time advances by drawn
durations, so thousands of two-hour runs take seconds.

- The job runs training steps back to back; durations are drawn from the workload.
  After every step the policy is asked whether to save; a save blocks training for a
  drawn duration. The run starts from a checkpoint (a resumed job).
- The machine is reclaimed when the true deadline is reached. The deadline may move
  mid-run; the job learns of a move **{delay} s** after it happened (the daemon serves it
  after its next poll). A deadline known before the run is known at once.
- A save still in progress at the reclaim is lost. A policy that says "stop" ends the
  job (the documented `CheckpointGuard` loop `break`s); the machine then idles.
- Every policy meets the same trace for a seed: step *i* and save *k* take the same
  time and the deadline moves at the same instants (common random numbers; `random`
  seeded with `"<workload>/<seed>/..."`, so results are identical on every machine).

## Workloads

`step max` and `save max` are the largest durations the workload can draw; they set
feasibility and the final window. Stress workloads hide something from a policy that
only knows its own measurements; they are reported apart.

| workload | description | step max s | save max s | stress: what it hides |
|---|---|---:|---:|---|
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
the ESI guide configures; `verl-r0` uses verl's own default, 0 s.
`sidecar` is the real `sidecar.train.policy.SavePolicy` (not a copy), called as
`CheckpointGuard` calls it: `record_step` after each step, `evaluate` for "save now?",
`record_save` (with the deciding budget and the deadline known when the save started)
after each save, `evaluate` again for "stop?".

## Metrics (per reclaim, averaged over seeds)

- **lead time**: reclaim time minus the time the job learned the deadline that was
  enforced (the whole run for a release known from the start).
- **feasible**: lead time >= step max + save max: from the worst moment (a worst-case
  step just started) one more step and one save still fit. Where no run is feasible
  the table says "{infeasible}"; such runs are not counted as a policy's misses.
- **final window**: opens at the later of the moment the job learned the enforced
  deadline and `W` before the reclaim, `W = step max + save max + {margin} s` (the seed
  rule's budget with the workload's worst step and save and the guide's margin).
- **missed**: at the reclaim, training was done since the newest completed checkpoint
  and that checkpoint was completed before the final window opened. A job that saved
  and stopped loses nothing and does not miss, even if it then idled.
- **lost min**: training time (whole steps and the step cut by the reclaim) since the
  newest completed checkpoint: GPU-minutes per GPU to redo (multiply by the job's GPU
  count). mean / p95 / max over the seeds.
- **saves**: completed saves per run. **saves in final window**: saves ending inside the
  final window, the one cut by the reclaim included. **cut by reclaim**: runs whose last
  save was in progress at the reclaim. **saving min**: time spent saving (cut save
  included). **idle min**: time between the policy's stop and the reclaim.

## Results

{plot}
{table}
## Reading the results

- Periodic saving loses about half its interval per reclaim on average and up to a
  whole interval (plus a step and a save), whatever the deadline does; "missed" counts
  the runs whose last checkpoint was older than the final window.
- verl keeps saving on every step inside its window, each save adding to its running
  max and so widening the window; the last save is usually cut by the reclaim. With
  `esi_redundant_time = 0` the save starts about one step + 60 s before the reclaim and
  a save longer than that is lost: every run misses on slow saves.
- The sidecar saves once per deadline and stops: it loses no work, and pays with the
  idle column (the margin left after its save, about 2 min on steady work) instead of
  verl's repeated saves. When the release is extended after the job stopped, the
  machine idles until the new deadline unless something restarts the job; its save then
  ended before the new final window (saves in final window below 1), but nothing is lost.
- A save covers deadlines (up to one budget after it started) only if it was made for
  one: the deadline was known when the save started and already inside the rule's
  window. A periodic save made before a notice or a brought-forward release arrived no
  longer makes the policy stop at once: the minute of training done since gets its own
  final save. Before this rule, that cost `sidecar+periodic-30` 3/200 misses on
  `spot-notice-120s` and 1/200 on `brought-forward` (up to 1 min lost each); now 0. A
  periodic save made inside the window is the final save, and a notice learned while a
  save is being written needs no second save (nothing was trained since).
- Short-lead notices: where the notice arrives too late for a step and a save, only a
  periodic save bounds the loss, hence `sidecar+periodic-30`.
- Stress workloads: a save never measured is assumed to take 60 s (`save_seconds`);
  configure it, or let the guard measure periodic saves. A spike rarer than the step
  window (100 steps) is forgotten by the estimate; a longer `window` keeps it.
  Both defaults are kept on purpose (see `sidecar/train/policy.py`): a larger assumed save
  would stop every other job earlier for nothing, and a longer window would also keep a
  one-off warm-up step in the budget, which the step times alone cannot tell from a
  rare recurring spike.
""".replace("{infeasible}", INFEASIBLE)
