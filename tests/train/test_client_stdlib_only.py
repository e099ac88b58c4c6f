"""``pip install esi-sidecar`` has no dependencies: the training side must run on the
standard library alone, and on the oldest Python we support (3.9) when one is installed.

Each run makes a bare virtual environment (no pip, no site-packages of ours), puts only
the source tree on the path, and in it imports the training side (``sidecar.train.client``,
``sidecar.checkpoint.folders``, the verl and torch.distributed integrations), takes decisions
against a live daemon (started here, in the test process, which has the server extras),
runs ``esi-sidecar status`` against it, and lists every server dependency or daemon
module that got imported.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import venv
from pathlib import Path
from typing import Optional

import pytest
from daemon_harness import serve_daemon

from sidecar.checkpoint.folders import latest_valid, list_checkpoints

SOURCE_ROOT = Path(__file__).resolve().parents[2]

# Never imported on the training side: the server's dependencies and the daemon's modules.
FORBIDDEN_PACKAGES = (
    "fastapi",
    "uvicorn",
    "pydantic",
    "pydantic_core",
    "starlette",
    "dateutil",
    "prometheus_client",
    "anyio",
    "h11",
    "httpx",
    "boto3",
    "botocore",
    "s3transfer",
    "watchdog",
    "moto",
    "volcenginesdkcore",
    "volcenginesdkecs",
    "volcengine",
)
FORBIDDEN_MODULES = (
    "sidecar.host.upload",
    "sidecar.host.poller",
    "sidecar.host.store",
    "sidecar.host.api",
    "sidecar.host.daemon",
    # Not sidecar.host.sources: the sources' specs (standard library only) make the
    # settings table the parser is built from (issue 21, item 5); their clients (the SDK,
    # urllib3) load only when a source is built, which FORBIDDEN_PACKAGES checks here.
)

CHILD = r"""
import importlib.util, json, sys

# The environment really is bare: the server's dependencies cannot even be found.
missing = {name: importlib.util.find_spec(name) is None for name in ("fastapi", "pydantic")}

import sidecar
import sidecar.checkpoint.folders
import sidecar.integrations.distributed
import sidecar.integrations.verl
from sidecar.train.client import SidecarClient
from sidecar.train.guard import CheckpointGuard
from sidecar.train.policy import SavePolicy

guard = CheckpointGuard(SidecarClient(sys.argv[1]),
                        SavePolicy(save_seconds=100.0, top_up_seconds=None), environ={},
                        wait_for_release=False)
guard.record_step(1.0)
save_now = guard.should_save()
with guard.saving():
    pass
stop = guard.should_stop()
status = guard.status()

sidecar.integrations.verl.configure(sys.argv[1], environ={})
verl_save = sidecar.integrations.verl.should_save_ckpt_esi(10, 100, 120)

print(json.dumps({
    "python": list(sys.version_info[:2]),
    "missing": missing,
    "save_now": save_now,
    "stop": stop,
    "source": status.deadline_source,
    "remaining": status.remaining_seconds,
    "verl_save": verl_save,
    "modules": sorted(sys.modules),
    "exported": sorted(sidecar.__all__),
}))
"""


def _forbidden(modules: list[str]) -> list[str]:
    return sorted(
        name
        for name in modules
        if name.split(".")[0] in FORBIDDEN_PACKAGES
        or name.startswith("volcengine")
        or any(name == m or name.startswith(m + ".") for m in FORBIDDEN_MODULES)
        if name not in PURE_HOST_MODULES
    )


# The upload plan is pure, standard library only (tests/test_layout.py): the simulator's
# sub-command, registered with the parser, runs the uploader's own estimate.
PURE_HOST_MODULES = ("sidecar.host.upload", "sidecar.host.upload.plan")


def _python39() -> Optional[str]:
    """A working python3.9 if this machine has one (PATH, then pyenv's versions)."""
    candidates = [shutil.which("python3.9")]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.9*/bin/python3.9")))
    for candidate in candidates:
        if not candidate:
            continue
        try:
            result = subprocess.run(
                [candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 9))"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if result.returncode == 0 and result.stdout.strip() == "True":
            return candidate
    return None


def _bare_python(base: str, folder: Path) -> Path:
    """A venv without pip: nothing but the standard library of ``base``."""
    if base == sys.executable:
        venv.EnvBuilder(with_pip=False, clear=True).create(folder)
    else:
        subprocess.run([base, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=60)
    return folder / "bin" / "python"


INTERPRETERS = [
    pytest.param(sys.executable, id="current"),
    pytest.param("python3.9", id="python3.9"),
]


@pytest.mark.parametrize("interpreter", INTERPRETERS)
def test_client_runs_on_the_standard_library_alone(interpreter: str, tmp_path: Path) -> None:
    if interpreter == "python3.9":
        found = _python39()
        if found is None:
            pytest.skip("no python3.9 on this machine")
        interpreter = found
    python = _bare_python(interpreter, tmp_path / "venv")
    environment = {
        "PATH": os.environ.get("PATH", ""),
        "PYTHONPATH": str(SOURCE_ROOT),
        "PYTHONNOUSERSITE": "1",
    }
    with serve_daemon(sources=("static",), expires_at=repr(time.time() + 200)) as daemon:
        result = subprocess.run(
            [str(python), "-c", CHILD, daemon.url],
            capture_output=True,
            text=True,
            env=environment,
            cwd=tmp_path,
            timeout=60,
        )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["missing"] == {"fastapi": True, "pydantic": True}
    assert "sidecar.integrations.verl" in report["modules"]
    assert _forbidden(report["modules"]) == []
    # A real decision against the live daemon: 1 + 100 + 120 s budget > 200 s left.
    assert report["save_now"] is True
    assert report["stop"] is True
    assert report["source"] == "daemon"
    assert 150 < report["remaining"] <= 200
    assert report["verl_save"] is True  # verl's rule: 200 s left <= 10 + 100 + 120
    assert "CheckpointGuard" in report["exported"]
    if "3.9" in interpreter:
        assert report["python"] == [3, 9]


def test_cli_status_imports_no_server_module(tmp_path: Path) -> None:
    """``esi-sidecar status`` runs in a training container that has the base install only."""
    python = _bare_python(sys.executable, tmp_path / "venv")
    environment = {
        "PATH": os.environ.get("PATH", ""),
        "PYTHONPATH": str(SOURCE_ROOT),
        "PYTHONNOUSERSITE": "1",
    }
    with serve_daemon(sources=("static",), expires_at=repr(time.time() + 200)) as daemon:
        result = subprocess.run(
            # -X importtime: every module the command imports, one line each, on stderr.
            [str(python), "-X", "importtime", "-m", "sidecar.cli", "status", "--url", daemon.url],
            capture_output=True,
            text=True,
            env=environment,
            cwd=tmp_path,
            timeout=60,
        )
    assert result.returncode == 0, result.stderr
    assert "static" in result.stdout  # a real answer from the live daemon
    imported = [
        line.rsplit("|", 1)[1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    ]
    assert "sidecar.train.client" in imported  # sidecar.cli itself runs as __main__
    assert _forbidden(imported) == []


def test_example_runs_without_torch(tmp_path: Path) -> None:
    """examples/plain_pytorch.py falls back to its toy model, makes the final save at
    once (6 s left), trains on towards the top-up save, waits for the release and exits
    with EXIT_RELEASED (75); resumed, it runs to the end from the newest checkpoint."""
    python = _bare_python(sys.executable, tmp_path / "venv")
    with socket.socket() as sock:  # a port nobody listens on: no daemon, env fallback
        sock.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    checkpoints = tmp_path / "checkpoints"
    command = [str(python), str(SOURCE_ROOT / "examples" / "plain_pytorch.py")]
    environment = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(SOURCE_ROOT)}
    environment["ESI_SIDECAR_URL"] = dead_url
    released = subprocess.run(
        [*command, "--steps", "1000000000", "--release-in", "6", "--save-seconds", "1",
         "--checkpoints", str(checkpoints)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=60,
    )
    assert released.returncode == 75, released.stderr
    assert "the release time has passed" in released.stderr
    assert "deadline from env" in released.stdout
    saved = latest_valid(checkpoints)  # written through atomic_checkpoint, so it validates
    assert saved is not None
    assert json.loads((saved.path / "state.json").read_text())["step"] == saved.step
    # The final save at step 0, then a top-up about 5 s before the release. The toy's
    # steps take microseconds, less than the loop around them, so the one-step window of
    # the top-up can be stepped over: then there is none, and training stopped there.
    steps = [c.step for c in list_checkpoints(checkpoints)]
    if "top-up checkpoint now" in released.stderr:
        assert steps == [saved.step, 0] and saved.step > 0
        # It left the loop at the top-up save.
        assert f"model=PlainModel ran to step {saved.step + 1}/1000000000" in released.stdout
    else:
        assert steps == [0] and "no further step fits" in released.stderr
    # Resumed without a deadline: runs to the end from the newest checkpoint.
    total = saved.step + 5
    resumed = subprocess.run(
        [*command, "--steps", str(total), "--checkpoints", str(checkpoints)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=60,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"ran to step {total}/{total}" in resumed.stdout
