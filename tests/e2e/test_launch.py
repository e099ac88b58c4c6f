"""``esi-sidecar run`` (docs/launch.md): a released job resumes on the next machine with no
step lost, signals reach the command's whole process group, the exit codes launchers act
on, and the SkyPilot, Kubernetes Job and Slurm recipes as the page gives them.

Everything real: the daemon on 127.0.0.1 (static deadline) with its uploader copying to a
volume folder, the guard in a training script, the CLI as a subprocess. The one stand-in
is Slurm's ``scontrol`` (the cluster is the outer edge).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Optional

import pytest
from daemon_harness import serve_daemon, wait_for

from sidecar.checkpoint.folders import atomic_checkpoint, latest_valid
from sidecar.host.launch import (
    EXIT_CANNOT_EXECUTE,
    EXIT_NOT_FOUND,
    EXIT_RESTORE_FAILED,
    EXIT_USAGE,
    FORWARDED_SIGNALS,
    exit_status,
)
from sidecar.train.client import SidecarClient
from sidecar.train.release_wait import EXIT_RELEASED

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "launch.md"

# A training job as a user writes it: resume from the newest valid checkpoint, train, save
# when the guard says so, leave the loop with EXIT_RELEASED when the release comes.
TRAIN = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from sidecar import EXIT_RELEASED, CheckpointGuard
    from sidecar.checkpoint.folders import atomic_checkpoint, latest_valid
    from sidecar.train.policy import SavePolicy

    root, total = Path(sys.argv[1]), int(sys.argv[2])
    found = latest_valid(root)
    start = 0 if found is None else json.loads((found.path / "state.json").read_text())["step"] + 1
    print(json.dumps({"start": start, "restored": None if found is None else found.step}),
          flush=True)
    guard = CheckpointGuard(policy=SavePolicy(save_seconds=1.0, redundant_seconds=2.0),
                            refresh_seconds=0.2)
    for step in range(start, total):
        with guard.step():
            time.sleep(0.05)
        print(json.dumps({"step": step}), flush=True)
        if guard.should_save():
            with guard.saving(step), atomic_checkpoint(root, step) as folder:
                (folder / "state.json").write_text(json.dumps({"step": step}))
            print(json.dumps({"saved": step}), flush=True)
        if guard.should_stop():
            sys.exit(EXIT_RELEASED if guard.released else 0)
""")


def clean_env(**extra: str) -> dict[str, str]:
    """This worktree's code in every child; no deadline, daemon or upload setting leaking in
    from the machine running the tests."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("ESI_SIDECAR_", "MLP_", "SAGEMAKER_"))}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def esi_sidecar(*args: str, env: Optional[dict[str, str]] = None,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar.cli", *args], capture_output=True,
                          text=True, cwd=REPO, env=env or clean_env(), timeout=timeout)


def lines(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_a_released_job_resumes_from_the_volume_with_no_step_lost(tmp_path: Path) -> None:
    local, volume = tmp_path / "local", tmp_path / "volume"
    local.mkdir()
    volume.mkdir()
    train = tmp_path / "train.py"
    train.write_text(TRAIN)
    # The release in 8 s: the save comes when about 3 s are left, then the wait for it.
    settings = {"sources": ("static",), "expires_at": str(time.time() + 8),
                "upload_from": local, "upload_to": volume.as_uri(), "upload_scan_interval": 0.2}
    with serve_daemon(**settings) as daemon:
        first = esi_sidecar("run", "--", sys.executable, str(train), str(local), "100000",
                            env=clean_env(ESI_SIDECAR_URL=daemon.url))
        assert first.returncode == EXIT_RELEASED, first.stderr
        assert "released (exit 75)" in first.stderr
        events = lines(first.stdout)
        trained = [e["step"] for e in events if "step" in e]
        saved = [e["saved"] for e in events if "saved" in e]
        assert saved and trained[-1] == saved[-1]  # nothing trained after the last save
        client = SidecarClient(daemon.url, timeout=5)
        wait_for(lambda: client.last_durable_step() == saved[-1], timeout=30)

    # The next machine: the local disk is gone; the daemon there has no deadline soon.
    for path in sorted(local.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z") as daemon:
        second = esi_sidecar("run", "--restore-from", volume.as_uri(), "--to", str(local), "--",
                             sys.executable, str(train), str(local), str(saved[-1] + 6),
                             env=clean_env(ESI_SIDECAR_URL=daemon.url))
    assert second.returncode == 0, second.stderr
    assert f"(step {saved[-1]}) restored from" in second.stderr
    events = lines(second.stdout)
    assert events[0] == {"start": saved[-1] + 1, "restored": saved[-1]}
    assert [e["step"] for e in events if "step" in e] == list(range(saved[-1] + 1,
                                                                    saved[-1] + 6))


def test_a_volume_restore_needs_no_boto3(tmp_path: Path) -> None:
    volume, local = tmp_path / "volume", tmp_path / "local"
    with atomic_checkpoint(volume, 7) as folder:
        (folder / "state.json").write_text('{"step": 7}')
    code = textwrap.dedent(f"""
        import sys
        for name in ("boto3", "botocore", "s3transfer"):
            sys.modules[name] = None  # import fails, as without the [upload] extra
        from sidecar.cli import main
        code = main(["run", "--restore-from", {volume.as_uri()!r}, "--to", {str(local)!r},
                     "--", sys.executable, "-c", "pass"])
        loaded = [m for m in sys.modules if m.split(".")[0] in ("boto3", "botocore")
                  and sys.modules[m] is not None]
        print(code, loaded)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, env=clean_env(), timeout=60)
    assert result.stdout.strip() == "0 []", result.stderr
    found = latest_valid(local)
    assert found is not None and found.step == 7


# The child and a grandchild in its group each write down the signal they got, then exit 40.
CATCHER = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    out = sys.argv[1]
    def got(signum, frame):
        with open(out + "." + str(os.getpid()), "w") as handle:
            handle.write(signal.Signals(signum).name)
        sys.exit(40)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), got)
    if len(sys.argv) == 2:
        subprocess.Popen([sys.executable, __file__, out, "grandchild"])
    with open(out + ".ready." + str(os.getpid()), "w"):
        pass
    while True:
        time.sleep(0.05)
""")


@pytest.mark.parametrize("signum", FORWARDED_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_to_the_launcher_reaches_the_commands_whole_group(
    tmp_path: Path, signum: int
) -> None:
    script = tmp_path / "catcher.py"
    script.write_text(CATCHER)
    out = tmp_path / "got"
    launcher = subprocess.Popen([sys.executable, "-m", "sidecar.cli", "run", "--",
                                 sys.executable, str(script), str(out)], cwd=REPO,
                                env=clean_env(), stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(list(tmp_path.glob("got.ready.*"))) == 2, timeout=30)
        launcher.send_signal(signum)
        assert launcher.wait(timeout=30) == 40  # the command's own code
    finally:
        launcher.kill()
        launcher.wait()
        assert launcher.stderr is not None
        launcher.stderr.close()
    wait_for(lambda: len(list(tmp_path.glob("got.[0-9]*"))) == 2, timeout=10)
    names = {path.read_text() for path in tmp_path.glob("got.[0-9]*")}
    assert names == {signal.Signals(signum).name}  # child and grandchild, once each


def test_a_command_killed_by_a_signal_exits_128_plus_n(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    sleeper = f"open({str(ready)!r}, 'w').close(); import time; time.sleep(60)"
    launcher = subprocess.Popen([sys.executable, "-m", "sidecar.cli", "run", "--",
                                 sys.executable, "-c", sleeper], cwd=REPO, env=clean_env(),
                                stderr=subprocess.PIPE, text=True)
    try:
        wait_for(ready.exists, timeout=30)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
        assert launcher.stderr is not None
        assert "killed by SIGTERM (exit 143)" in launcher.stderr.read()
    finally:
        launcher.kill()
        launcher.wait()
        assert launcher.stderr is not None
        launcher.stderr.close()
    assert exit_status(-9) == 137 and exit_status(75) == 75 and exit_status(0) == 0


def test_the_launchers_own_exit_codes(tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    touch = [sys.executable, "-c", f"open({str(ran)!r}, 'w').close()"]
    missing = esi_sidecar("run", "--", str(tmp_path / "no-such-program"))
    assert missing.returncode == EXIT_NOT_FOUND == 127
    assert "command not found" in missing.stderr
    assert esi_sidecar("run", "--", str(tmp_path)).returncode == EXIT_CANNOT_EXECUTE == 126
    assert esi_sidecar("run").returncode == EXIT_USAGE
    assert esi_sidecar("run", "--to", str(tmp_path / "x"), "--", *touch).returncode == 2
    failed = esi_sidecar("run", "--restore-from", (tmp_path / "not-mounted").as_uri(),
                         "--to", str(tmp_path / "local"), "--", *touch)
    assert failed.returncode == EXIT_RESTORE_FAILED == 74
    assert "restore failed, the command was not run" in failed.stderr
    assert "is the volume mounted?" in failed.stderr and not ran.exists()
    bad_url = esi_sidecar("run", "--restore-from", "ftp://x/y", "--to", str(tmp_path / "l"),
                          "--", *touch)
    assert bad_url.returncode == EXIT_USAGE and not ran.exists()
    # Nothing on the volume yet: the first start of the job, which runs fresh.
    empty = tmp_path / "empty"
    empty.mkdir()
    fresh = esi_sidecar("run", "--restore-from", empty.as_uri(), "--to",
                        str(tmp_path / "local"), "--", *touch)
    assert fresh.returncode == 0 and ran.exists()
    assert "nothing to restore" in fresh.stderr and "starting fresh" in fresh.stderr
    # No upload setting: nothing to restore, the command alone.
    quiet = esi_sidecar("run", "--", sys.executable, "-c", "raise SystemExit(5)")
    assert quiet.returncode == 5 and quiet.stderr == ""


def test_run_reads_the_upload_variables_that_restore_reads(tmp_path: Path) -> None:
    """ESI_SIDECAR_UPLOAD_TO / _FROM, as `esi-sidecar restore` reads them (issue 39: run
    ignored them and started fresh over a checkpoint on the volume)."""
    volume, local = tmp_path / "volume", tmp_path / "local"
    with atomic_checkpoint(volume, 30) as folder:
        (folder / "model.pt").write_bytes(b"weights")
    show = [sys.executable, "-c", "import sys; from sidecar.checkpoint.folders import "
            f"latest_valid; print(latest_valid({str(local)!r}).step)"]
    env = clean_env(ESI_SIDECAR_UPLOAD_TO=volume.as_uri(), ESI_SIDECAR_UPLOAD_FROM=str(local))
    restored = esi_sidecar("run", "--", *show, env=env)
    assert restored.returncode == 0, restored.stderr
    assert restored.stdout.strip() == "30" and "(step 30) restored from" in restored.stderr
    gone = esi_sidecar("run", "--", *show, env=clean_env(
        ESI_SIDECAR_UPLOAD_TO=(tmp_path / "gone").as_uri(), ESI_SIDECAR_UPLOAD_FROM=str(local)))
    assert gone.returncode == EXIT_RESTORE_FAILED and "is the volume mounted?" in gone.stderr
    half = esi_sidecar("run", "--", *show, env=clean_env(ESI_SIDECAR_UPLOAD_TO=volume.as_uri()))
    assert half.returncode == EXIT_USAGE and "ESI_SIDECAR_UPLOAD_FROM" in half.stderr


# ---------------------------------------------------------------------- the recipes


def doc_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", DOC.read_text(), re.S | re.M)


def recipe(language: str, marker: str) -> str:
    (block,) = [block for block in doc_blocks(language) if marker in block]
    return block


def test_the_kubernetes_job_takes_a_release_for_no_failure() -> None:
    yaml = pytest.importorskip("yaml")
    job = yaml.safe_load(recipe("yaml", "kind: Job"))
    spec = job["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
    (container,) = spec["template"]["spec"]["containers"]
    assert container["command"][:2] == ["esi-sidecar", "run"]
    rules = spec["podFailurePolicy"]["rules"]
    by_code = {code: rule["action"] for rule in rules if "onExitCodes" in rule
               for code in rule["onExitCodes"]["values"]}
    assert by_code[EXIT_RELEASED] == "Ignore"
    assert all(rule["onExitCodes"]["containerName"] == container["name"]
               for rule in rules if "onExitCodes" in rule)
    assert {by_code[c] for c in (EXIT_USAGE, EXIT_CANNOT_EXECUTE, EXIT_NOT_FOUND)} == {"FailJob"}
    assert EXIT_RESTORE_FAILED not in by_code  # retried under backoffLimit
    try:
        import kubernetes_validate  # type: ignore[import-not-found]
    except ImportError:
        return  # schema check where the package is installed, as for the DaemonSet
    kubernetes_validate.validate(job, "1.30", strict=True)


def test_the_skypilot_recipe_always_recovers_on_a_release() -> None:
    yaml = pytest.importorskip("yaml")
    task = yaml.safe_load(recipe("yaml", "job_recovery"))
    recovery = task["resources"]["job_recovery"]
    # SkyPilot's field (docs/launch.md): one exit code or a list of them, each 0-255.
    codes = recovery["recover_on_exit_codes"]
    codes = codes if isinstance(codes, list) else [codes]
    assert EXIT_RELEASED in codes and all(isinstance(c, int) and 0 <= c <= 255 for c in codes)
    assert recovery["strategy"] in ("FAILOVER", "EAGER_NEXT_REGION")
    assert isinstance(recovery["max_restarts_on_errors"], int)
    assert "esi-sidecar run --restore-from" in task["run"]
    for script in (task["setup"], task["run"]):
        subprocess.run(["bash", "-n"], input=script, text=True, check=True, timeout=30)


@pytest.mark.parametrize("code, requeued, status", [(EXIT_RELEASED, True, 0), (1, False, 1),
                                                    (0, False, 0)])
def test_the_slurm_script_requeues_on_a_release_only(
    tmp_path: Path, code: int, requeued: bool, status: int
) -> None:
    script = tmp_path / "train.sbatch"
    script.write_text(recipe("bash", "#SBATCH --requeue"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    stand_ins = {
        "scontrol": f'#!/bin/sh\necho "$@" >> {calls}\n',
        "esi-sidecar": f'#!/bin/sh\nexec {sys.executable} -m sidecar.cli "$@"\n',
        "python": f'#!/bin/sh\nexec {sys.executable} "$@"\n',
    }
    for name, text in stand_ins.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "train.py").write_text(f"raise SystemExit({code})\n")
    empty = tmp_path / "volume"
    empty.mkdir()
    env = clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID="4242",
                    VOLUME=empty.as_uri(), LOCAL=str(tmp_path / "local"))
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == status, result.stderr
    assert (calls.read_text().split() if calls.exists() else []) == (
        ["requeue", "4242"] if requeued else [])
