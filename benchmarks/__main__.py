"""``python -m benchmarks`` (``make bench``): run every benchmark, write docs/benchmarks.md.

Benchmarks are not tests: each prints figures and ratios against a baseline measured in
the same run, and states its targets as met or not met; none fails on a figure. The exit
status is non-zero only when a benchmark could not run at all.

    python -m benchmarks                     # everything (about 25 minutes; the soak: 10)
    python -m benchmarks --quick             # fewer requests and repeats: a smoke run
    python -m benchmarks --only client       # one benchmark (comma-separate several)
    python -m benchmarks --out /tmp/b.md     # write elsewhere
"""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks.md"
PACKAGES = (
    "esi-sidecar", "fastapi", "starlette", "uvicorn", "h11", "httptools", "uvloop",
    "pydantic", "pydantic-core", "prometheus-client", "volcenginesdk-core",
    "volcenginesdk-ecs", "torch",
)

Runner = Callable[[bool], dict[str, Any]]


@dataclass(frozen=True)
class Benchmark:
    name: str
    summary: str
    run: Runner


def _throughput(quick: bool) -> dict[str, Any]:
    from benchmarks.bench_daemon import main_throughput

    return main_throughput(quick)


def _client(quick: bool) -> dict[str, Any]:
    from benchmarks.bench_client import main_overhead

    return main_overhead(quick)


def _notice(quick: bool) -> dict[str, Any]:
    from benchmarks.bench_client import main_notice

    return main_notice(quick)


def _reclaim(quick: bool) -> dict[str, Any]:
    from benchmarks.bench_reclaim import main

    return main(quick)


def _reduce(quick: bool) -> dict[str, Any]:
    try:
        import torch.distributed  # noqa: F401  (the ranks agree through gloo)
    except ImportError:
        raise NotRun("torch is not installed") from None
    from benchmarks.bench_reduce import main

    return main(quick)


def _fleet(quick: bool) -> dict[str, Any]:
    from benchmarks.bench_fleet import main

    return main(quick)


def _footprint(quick: bool) -> dict[str, Any]:
    from benchmarks.bench_daemon import main_footprint

    return main_footprint(quick)


class NotRun(Exception):
    """A benchmark that cannot run here (a missing module, say); noted, not a failure."""


def _checkpoint(quick: bool) -> dict[str, Any]:
    # Hook for benchmarks/bench_checkpoint.py (another module's benchmark): `main() -> dict`.
    try:
        from benchmarks import bench_checkpoint
    except ImportError as exc:
        raise NotRun(f"benchmarks/bench_checkpoint.py could not be imported ({exc})") from None
    main: Callable[..., dict[str, Any]] = bench_checkpoint.main
    if "quick" in inspect.signature(main).parameters:
        return main(quick=quick)
    if quick:
        raise NotRun("skipped with --quick (bench_checkpoint.main() has no quick mode)")
    try:
        import torch  # noqa: F401  (the checkpoint benchmark saves torch tensors)
    except ImportError:
        raise NotRun("torch is not installed") from None
    result = main()
    result.setdefault("title", "Checkpoint save: `atomic_checkpoint` vs `torch.save`")
    result.setdefault("description", (bench_checkpoint.__doc__ or "").strip())
    return result


def _upload(quick: bool) -> dict[str, Any]:
    # benchmarks/bench_upload.py: `main(quick) -> dict`; needs boto3 and moto[server].
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as exc:
        raise NotRun(f"{exc.name} is not installed (the [server] and [test] extras)") from None
    from benchmarks import bench_upload

    return bench_upload.main(quick=quick)


def _stream(quick: bool) -> dict[str, Any]:
    # benchmarks/bench_stream.py: needs boto3 and moto[server] for its S3 half.
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as exc:
        raise NotRun(f"{exc.name} is not installed (the [server] and [test] extras)") from None
    from benchmarks import bench_stream

    return bench_stream.main(quick=quick)


def _restore(quick: bool) -> dict[str, Any]:
    # benchmarks/bench_restore.py: needs boto3 and moto[server] for its S3 half.
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as exc:
        raise NotRun(f"{exc.name} is not installed (the [server] and [test] extras)") from None
    from benchmarks import bench_restore

    return bench_restore.main(quick=quick)


def _resume(quick: bool) -> dict[str, Any]:
    from benchmarks import bench_resume

    return bench_resume.run(repeats=3 if quick else 10, mib=64 if quick else 1024)


def _soak(quick: bool) -> dict[str, Any]:
    from benchmarks.bench_soak import main

    return main(quick)


BENCHMARKS = (
    Benchmark("throughput", "daemon /v1/expiry throughput and latency vs bare uvicorn",
              _throughput),
    Benchmark("client", "client per-step overhead (should_save cached / uncached)", _client),
    Benchmark("notice", "notice latency: emulator moves the release -> client sees it",
              _notice),
    Benchmark("reclaim", "reclaim notices on each cloud's emulator -> daemon -> should_save()",
              _reclaim),
    Benchmark("reduce", "per-step cost of the ranks' agreement: every step vs scheduled "
              "(8 gloo ranks)", _reduce),
    Benchmark("fleet", "a fleet polling one account: fixed vs adaptive schedule "
              "(simulated clock)", _fleet),
    Benchmark("footprint", "daemon memory, idle CPU, start-up, install size", _footprint),
    Benchmark("checkpoint", "atomic_checkpoint vs torch.save (benchmarks/bench_checkpoint.py)",
              _checkpoint),
    Benchmark("upload", "checkpoint upload: the uploader vs boto3 upload_file, to moto on "
              "loopback", _upload),
    Benchmark("stream", "streaming upload: save start to durable while the save writes vs "
              "after it, and unchanged files (volume, moto)", _stream),
    Benchmark("restore", "restore from a volume vs cp -r, from S3 (moto) vs boto3 "
              "download_file, cold caches", _restore),
    Benchmark("resume", "the checkpoint waiting: esi-sidecar run to the job's command vs the "
              "command started directly (1 GiB put in place by the follower)", _resume),
    Benchmark("soak", "the daemon for 10 min: 64 keep-alive clients, hostile connections, "
              "rotating cloud faults", _soak),
)


# ---------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory() -> str:
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def _load() -> str:
    try:
        return " / ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "unknown"


def _version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head or "unknown"


def machine() -> dict[str, str]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    versions = ", ".join(
        f"{name} {version}" for name in PACKAGES if (version := _version(name)) is not None
    )
    absent = ", ".join(name for name in PACKAGES if _version(name) is None)
    return {
        "CPU": _cpu_model(),
        "cores": f"{os.cpu_count()} logical" + (f", {usable} usable" if usable else ""),
        "memory": _memory(),
        "OS": f"{platform.system()} {platform.release()}",
        "Python": f"{platform.python_implementation()} {platform.python_version()}",
        "packages": versions + (f" (not installed: {absent})" if absent else ""),
        "load average at start (1/5/15 min)": _load(),
    }


# ---------------------------------------------------------------------------- markdown


def _cell(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(columns: Sequence[Any], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return [*lines, ""]  # a blank line ends a Markdown table


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``a/b`` keys with scalar values; lists are summarised."""
    flat: dict[str, Any] = {}
    if isinstance(value, dict):
        for key, inner in value.items():
            flat.update(_flatten(inner, f"{prefix}/{key}" if prefix else str(key)))
    elif isinstance(value, (list, tuple)):
        numbers = [v for v in value if isinstance(v, (int, float))]
        flat[prefix] = (f"{len(value)} values" if len(numbers) != len(value) or not numbers
                        else ", ".join(_cell(float(v)) for v in numbers[:8])
                        + (" ..." if len(numbers) > 8 else ""))
    else:
        flat[prefix] = value
    return flat


def _generic(result: dict[str, Any]) -> list[str]:
    """For a result without ``tables`` (another module's ``main() -> dict``)."""
    lines: list[str] = []
    scalars = {k: v for k, v in result.items()
               if not isinstance(v, (dict, list, tuple)) and k not in ("title", "description")}
    if scalars:
        lines += _table(["setting", "value"], [[k, v] for k, v in scalars.items()])
    for key, value in result.items():
        if not isinstance(value, dict) or not value:
            continue
        if all(isinstance(inner, dict) for inner in value.values()):
            flat = {row: _flatten(inner) for row, inner in value.items()}
            columns = list(dict.fromkeys(c for row in flat.values() for c in row))
            lines += [f"**{key}**", ""]
            if len(columns) > len(flat):  # few wide rows read better turned on their side
                lines += _table(["figure", *flat],
                                [[c, *(values.get(c, "") for values in flat.values())]
                                 for c in columns])
            else:
                lines += _table([key, *columns],
                                [[row, *(values.get(c, "") for c in columns)]
                                 for row, values in flat.items()])
        else:
            lines += [f"**{key}**", ""]
            lines += _table(["figure", "value"], list(_flatten(value).items()))
    return lines


def _met(value: Optional[bool]) -> str:
    return "n/a" if value is None else ("**met**" if value else "**not met**")


def render(outcomes: list[tuple[Benchmark, str, dict[str, Any], float]], *, quick: bool,
           command: str, started: datetime, seconds: float, info: dict[str, str]) -> str:
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m benchmarks` (`make bench`); do not edit by hand. Benchmarks are "
        "not tests: each figure comes with a baseline measured in the same run, and the "
        "targets from the issues are reported as met or not met, never enforced.",
        "",
        f"- Date: {started.strftime('%Y-%m-%d %H:%M UTC')}, took {seconds:.0f} s"
        + (" (**--quick**: smoke-run figures, fewer requests and repeats)" if quick else ""),
        f"- Command: `{command}`",
        f"- Commit: `{_commit()}` (plus any uncommitted changes in the working tree)",
        "",
        "## Machine",
        "",
    ]
    lines += _table(["", ""], list(info.items()))
    lines += [
        "The machine is shared: other processes (test suites) may run at the same time, "
        "which is why every figure is a median of repeats and compared with a baseline "
        "measured alongside it. Absolute numbers are this machine's; the ratios travel better.",
        "",
        "## Targets",
        "",
    ]
    target_rows = []
    for benchmark, status, result, _ in outcomes:
        for target in result.get("targets", []):
            target_rows.append([benchmark.name, target["target"], target["measured"],
                                _met(target.get("met"))])
        if status != "ok":
            target_rows.append([benchmark.name, "(benchmark)", status, "n/a"])
    lines += _table(["benchmark", "target", "measured", "result"], target_rows)
    lines.pop()
    for number, (benchmark, status, result, elapsed) in enumerate(outcomes, start=1):
        title = result.get("title", benchmark.summary)
        lines += ["", f"## {number}. {title}", "",
                  f"`--only {benchmark.name}`; took {elapsed:.0f} s.", ""]
        if status != "ok":
            lines += [f"**{status}**", ""]
            continue
        if result.get("description"):
            lines += [str(result["description"]), ""]
        if "tables" in result:
            for table in result["tables"]:
                lines += [f"### {table['title']}", ""]
                lines += _table(table["columns"], table["rows"])
        else:
            lines += _generic(result)
        for note in result.get("notes", []):
            lines.append(f"- {note}")
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------- entry


def _parser() -> argparse.ArgumentParser:
    names = ", ".join(b.name for b in BENCHMARKS)
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run the benchmarks and write a Markdown report.",
    )
    parser.add_argument("--quick", action="store_true",
                        help="fewer requests and repeats: a smoke run (figures are rough)")
    parser.add_argument("--only", metavar="NAME",
                        help=f"run only these (comma-separated): {names}")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="where to write the report (default docs/benchmarks.md)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    selected = list(BENCHMARKS)
    if args.only:
        wanted = [name.strip() for name in args.only.split(",") if name.strip()]
        known = {b.name for b in BENCHMARKS}
        unknown = [name for name in wanted if name not in known]
        if unknown or not wanted:
            parser.error(f"unknown benchmark {', '.join(unknown) or '(none)'}; "
                         f"choose from {', '.join(sorted(known))}")
        selected = [b for b in BENCHMARKS if b.name in wanted]
    command = " ".join(["python -m benchmarks", *map(shlex.quote, sys.argv[1:] if argv is None
                                                       else argv)])
    started = datetime.now(timezone.utc)
    began = time.monotonic()
    info = machine()
    print(f"esi-sidecar benchmarks{' (quick)' if args.quick else ''}: "
          f"{len(selected)} to run on {info['CPU']}, {info['cores']}", flush=True)
    outcomes: list[tuple[Benchmark, str, dict[str, Any], float]] = []
    failed = 0
    for index, benchmark in enumerate(selected, start=1):
        print(f"[{index}/{len(selected)}] {benchmark.name}: {benchmark.summary}", flush=True)
        t0 = time.monotonic()
        try:
            result = benchmark.run(args.quick)
            status = "ok"
        except NotRun as exc:
            result, status = {}, f"not run: {exc}"
        except Exception as exc:  # report, keep going: one broken benchmark hides no other
            traceback.print_exc()
            result, status = {}, f"failed: {type(exc).__name__}: {exc}"
            failed += 1
        elapsed = time.monotonic() - t0
        outcomes.append((benchmark, status, result, elapsed))
        verdicts = [t.get("met") for t in result.get("targets", [])]
        met = sum(1 for v in verdicts if v)
        judged = sum(1 for v in verdicts if v is not None)
        summary = f"targets met {met}/{judged}" if judged else status
        print(f"    -> {status if status != 'ok' else summary} ({elapsed:.0f} s)", flush=True)
        for target in result.get("targets", []):
            print(f"       {_met(target.get('met')).strip('*'):8s} {target['target']}: "
                  f"{target['measured']}", flush=True)
    report = render(outcomes, quick=args.quick, command=command, started=started,
                    seconds=time.monotonic() - began, info=info)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report, encoding="utf-8")
    print(f"wrote {args.out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
