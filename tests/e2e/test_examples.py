"""The examples as examples/README.md says: every line of its table, word for word, from
a working folder of its own, with and without a daemon running.

Each line sets ``--release-in``, which wins over a daemon (the one running here has a
deadline an hour away and is not asked): the first line printed says so; the run trains,
saves, waits for the release and exits 75 (EXIT_RELEASED), printing a checkpoint under
./checkpoints/<example> and a ``resume:`` line. That line, run word for word in the same
folder, resumes from that checkpoint and trains to the end (following the daemon's far
deadline, or none). verl_launch.sh needs a real model and data: its syntax is checked, and
a run with a stand-in for verl.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
from daemon_harness import serve_daemon, wait_for

from sidecar import EXIT_RELEASED
from sidecar.train.client import ENV_URL
from sidecar.train.deadline import ENV_DEADLINE_VARIABLES

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
MORE_STEPS = 50  # the resume line trains this many past its checkpoint
# What each example of the table imports beyond the standard library and the sidecar: a
# line in the README without an entry here fails test_every_readme_line_has_a_test.
NEEDS: dict[str, tuple[str, ...]] = {
    "plain_pytorch.py": (),  # torch when it is there
    "torch_distributed.py": ("torch",),
    "torch_dcp.py": ("torch",),
    "hf_trainer.py": ("torch", "transformers", "accelerate"),
    "lightning_module.py": ("torch", "lightning"),
}
NOT_RUN = {"verl_launch.sh"}  # needs a model and a data set: test_verl_launch_script


def readme_lines() -> dict[str, str]:
    """examples/README.md's table: example file -> the command line in its ``run`` cell."""
    lines = {}
    for row in (EXAMPLES / "README.md").read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        named = re.fullmatch(r"\[([\w.]+)\]\(\1\)", cells[0]) if len(cells) >= 3 else None
        if named is not None:
            command = re.fullmatch(r"`([^`]+)`", cells[2])
            assert command is not None, row
            lines[named.group(1)] = command.group(1)
    return lines


README_ROWS = [
    pytest.param(script, line, id=script.split(".")[0],
                 marks=[pytest.mark.frameworks] if NEEDS.get(script) else [])
    for script, line in readme_lines().items() if script not in NOT_RUN
]


def test_every_readme_line_has_a_test() -> None:
    assert set(readme_lines()) == set(NEEDS) | NOT_RUN


def run(command: Sequence[str], url: str, cwd: Path, status: int = 0,
        timeout: float = 120) -> tuple[str, str]:
    """Run ``command`` with ESI_SIDECAR_URL=url in ``cwd``: (stdout, stderr), once it exited
    with ``status``. In a session of its own, so that a hang kills the ranks too."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_DEADLINE_VARIABLES}
    env.update({ENV_URL: url, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    process = subprocess.Popen(
        list(command), cwd=cwd, env=env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"{shlex.join(command)} still running after {timeout} s:\n"
                    f"{out[-2000:]}\n{err[-2000:]}")
    assert process.returncode == status, f"{out[-2000:]}\n{err[-3000:]}"
    return out, err


def as_written(line: str) -> list[str]:
    words = shlex.split(line)
    assert words[0] == "python", line
    return [sys.executable, *words[1:]]


def dead_url() -> str:
    """A loopback port nobody listens on: no daemon."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextmanager
def daemon_url(running: bool) -> Iterator[str]:
    """The URL the example is given: a daemon whose release is an hour away, or none."""
    if not running:
        yield dead_url()
        return
    with serve_daemon(sources=("static",), expires_at=repr(time.time() + 3600)) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        yield daemon.url


def steps(pattern: str, output: str) -> list[int]:
    """The numbers ``pattern`` finds, one per rank's line (``rank N: `` before it)."""
    return [int(n) for n in re.findall(rf"^(?:rank \d+: )?{pattern}", output, re.MULTILINE)]


@pytest.mark.parametrize("daemon_running", [False, True], ids=["no-daemon", "daemon"])
@pytest.mark.parametrize(("script", "line"), README_ROWS)
def test_readme_line_runs_as_written_saves_stops_and_resumes(
    script: str, line: str, daemon_running: bool, tmp_path: Path,
) -> None:
    for module in NEEDS[script]:
        pytest.importorskip(module)
    (tmp_path / "examples").symlink_to(EXAMPLES)  # `python examples/...` as in the README
    words = shlex.split(line)
    ranks = int(words[words.index("--nproc-per-node") + 1]) if "--nproc-per-node" in words else 1
    with daemon_url(daemon_running) as url:
        out, err = run(as_written(line), url, tmp_path, status=EXIT_RELEASED)
        shown = f"{out[-2000:]}\n{err[-3000:]}"
        assert re.fullmatch(r"deadline: --release-in [\d.]+ s \(at [\d:]+\); no daemon is asked",
                            out.splitlines()[0]), shown
        paths = [Path(p) for p in re.findall(r"(?:checkpoint|->) (/[^\s;]+)", out)]
        assert paths and all(path.exists() for path in paths), shown
        saved = paths[-1]  # the newest
        assert saved.parent == (tmp_path / "checkpoints" / script.split(".")[0]).resolve()
        found = re.search(r"(?:step_|checkpoint-|step=)(\d+)(?:\.ckpt)?$", saved.name)
        assert found is not None, saved
        step = int(found.group(1))
        assert step >= 1, shown  # trained before the save
        if ranks > 1:  # every rank saved, at the same step
            assert steps(r"saved: checkpoint at step (\d+)", out) == [step] * ranks, shown
        resume = re.findall(r"^resume: (.*)$", out, re.MULTILINE)
        assert len(resume) == 1, shown
        total = step + MORE_STEPS
        assert resume[0].endswith(f"--output checkpoints/{script.split('.')[0]} --steps {total}")

        out, err = run(as_written(resume[0]), url, tmp_path)
    shown = f"{out[-2000:]}\n{err[-3000:]}"
    assert out.splitlines()[0].startswith(f"deadline: the daemon's at {url} "), shown
    assert steps(r"start: resuming from step (\d+)", out) == [step] * ranks, shown
    assert re.findall(r"(?:done: trained|ran to step) (\d+)/(\d+)", out) == [
        (str(total), str(total))] * ranks, shown
    assert "stop:" not in out, shown
    assert saved.exists()  # still there: nothing removed it at exit


def test_plain_example_help_says_release_in_wins_and_keeps_checkpoints_alias(
    tmp_path: Path,
) -> None:
    text, _ = run([sys.executable, str(EXAMPLES / "plain_pytorch.py"), "--help"], dead_url(),
                  tmp_path)
    for option in ("--steps", "--output", "--release-in", "--save-seconds", "--redundant-seconds"):
        assert option in text
    assert "--checkpoints" not in text  # kept for old command lines, not shown
    assert "wins over a running daemon" in " ".join(text.split())


FAKE_MAIN_PPO = """
import json, sys
print("FAKE main_ppo " + json.dumps(sys.argv[1:]))
"""


def test_verl_launch_script(tmp_path: Path) -> None:
    """Syntax, then a run with a stand-in for verl that prints what it was given."""
    script = EXAMPLES / "verl_launch.sh"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(script)], check=True, timeout=30)
    fake = tmp_path / "fake"
    (fake / "verl" / "trainer").mkdir(parents=True)
    (fake / "verl" / "__init__.py").write_text("")
    (fake / "verl" / "trainer" / "__init__.py").write_text("")
    (fake / "verl" / "trainer" / "main_ppo.py").write_text(FAKE_MAIN_PPO)
    env = {k: v for k, v in os.environ.items() if k not in ENV_DEADLINE_VARIABLES}
    env.update(PYTHON=sys.executable, PYTHONPATH=f"{fake}{os.pathsep}{ROOT}")
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z") as daemon:
        wait_for(lambda: daemon.store.health().ok)
        env[ENV_URL] = daemon.url
        result = subprocess.run(
            ["bash", str(script), "data.train_files=x.parquet"],
            capture_output=True, text=True, env=env, timeout=60,
        )
    assert result.returncode == 0, result.stderr
    assert "esi-sidecar: release at 2030-01-01T00:00:00Z (source static)" in result.stdout
    assert (
        "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook="
        "sidecar.integrations.verl.install" in result.stdout
    )
    assert f"env_vars.ESI_SIDECAR_URL='{daemon.url}'" in result.stdout
    assert '"data.train_files=x.parquet"' in result.stdout

    env["PYTHONPATH"] = str(ROOT)  # no verl: a clear message before anything starts
    missing = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env,
                             timeout=60)
    assert missing.returncode == 2
    assert "verl is not installed" in missing.stderr
