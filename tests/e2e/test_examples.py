"""The examples run as a user runs them: as programs, against a real daemon on loopback.

First run: the daemon's static deadline is SAVE + REDUNDANT + TRAIN seconds ahead and the
example gets ``--save-seconds SAVE --redundant-seconds REDUNDANT``, so the rule (remaining
<= step + save + redundant) fires about TRAIN seconds after the daemon started: after many
millisecond steps where start-up is quicker than that, at the first step where it is not
(both are the behaviour under test). ``--steps`` is far more than fits in that time, so
only the guard can end the run. Expected: exactly one checkpoint, at the step where the
run stopped, and exit status 0 (75, ``EXIT_RELEASED``, from the Hugging Face example).
Second run: a daemon whose deadline is an hour away and ``--steps`` a few past the
checkpoint: it resumes from that checkpoint and finishes. Then the README's own lines,
read from examples/README.md and run word for word, with and without a daemon.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Callable, Optional

import pytest
from daemon_harness import serve_daemon, wait_for

from sidecar import EXIT_RELEASED
from sidecar.checkpoint.folders import list_checkpoints
from sidecar.train.client import ENV_URL
from sidecar.train.deadline import ENV_DEADLINE_VARIABLES

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SAVE, REDUNDANT, TRAIN = 1.0, 20.0, 5.0
UNBOUNDED_STEPS = 1_000_000  # the first run ends only through the guard
MORE_STEPS = 5  # the resumed run trains this many past the checkpoint
# No top-up save here: these pin "one save, stop, resume from it" through each framework
# (the top-up is tested through the plain example, and in the integration tests).
RULE = ["--save-seconds", str(SAVE), "--redundant-seconds", str(REDUNDANT),
        "--top-up-seconds", "off"]


def run(command: Sequence[str], url: str, cwd: Path, timeout: float = 90,
        status: int = 0) -> str:
    """Run ``command`` with ESI_SIDECAR_URL=url; its output, after checking exit ``status``.

    In a session of its own, so that a hang kills torchrun's workers too, not only torchrun.
    """
    env = {k: v for k, v in os.environ.items() if k not in ENV_DEADLINE_VARIABLES}
    env.update({ENV_URL: url, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    process = subprocess.Popen(
        list(command), cwd=cwd, env=env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{' '.join(command)} still running after {timeout} s:\n{output[-3000:]}")
    assert process.returncode == status, output[-3000:]
    return output


def steps(pattern: str, output: str) -> list[int]:
    return [int(n) for n in re.findall(pattern, output)]


def first_then_resumed(
    command: list[str], tmp_path: Path, between: Optional[Callable[[int], None]] = None,
    released: int = 0,
) -> tuple[int, str, str]:
    """Both runs; (the step saved at, first output, resumed output).

    ``between(step)`` runs after the first, e.g. to leave what a later save cut short
    would leave; ``released``: the first run's exit status.
    """
    with serve_daemon(
        sources=("static",), expires_at=repr(time.time() + SAVE + REDUNDANT + TRAIN)
    ) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        first = run([*command, "--steps", str(UNBOUNDED_STEPS), *RULE], daemon.url, tmp_path,
                    status=released)
    saved = steps(r"saved: checkpoint at step (\d+)", first)
    assert len(set(saved)) == 1, first[-3000:]  # once (per rank), all at one step
    step = saved[0]
    assert step >= 1
    assert set(steps(r"stop: step (\d+)", first)) == {step}, first[-3000:]

    if between is not None:
        between(step)
    total = step + MORE_STEPS
    with serve_daemon(sources=("static",), expires_at=repr(time.time() + 3600)) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        resumed = run([*command, "--steps", str(total), *RULE], daemon.url, tmp_path)
    assert set(steps(r"start: resuming from step (\d+)", resumed)) == {step}, resumed[-3000:]
    assert "saved:" not in resumed and "stop:" not in resumed, resumed[-3000:]
    assert set(re.findall(r"done: trained (\d+)/(\d+) steps", resumed)) == {
        (str(total), str(total))
    }, resumed[-3000:]
    return step, first, resumed


def hf_checkpoints(output: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in output.glob("checkpoint-*"))


def lightning_checkpoints(output: Path) -> list[int]:
    return sorted(steps(r"step=(\d+)\.ckpt", " ".join(p.name for p in output.rglob("*.ckpt"))))


def lightning_save_cut_short(output: Path) -> Callable[[int], None]:
    """What a later save killed half-way leaves: its temporary name, a few bytes."""
    def leave(step: int) -> None:
        name = f"esi-epoch=0-step={step + 100}.ckpt.tmp-4242"
        (output / name).write_bytes(b"half a checkpoint")
    return leave


FRAMEWORKS = [
    pytest.param("hf_trainer.py", ("transformers", "accelerate"), hf_checkpoints, None, 75,
                 id="hf"),
    pytest.param("lightning_module.py", ("lightning",), lightning_checkpoints,
                 lightning_save_cut_short, 75, id="lightning"),
]


@pytest.mark.frameworks
@pytest.mark.parametrize(("script", "needs", "checkpoints", "between", "released"), FRAMEWORKS)
def test_framework_example_saves_once_stops_and_resumes(
    script: str, needs: tuple[str, ...], checkpoints: Callable[[Path], list[int]],
    between: Optional[Callable[[Path], Callable[[int], None]]], released: int, tmp_path: Path,
) -> None:
    """The Lightning run also finds a save cut short next to ours, and skips it."""
    for module in ("torch", *needs):
        pytest.importorskip(module)
    output = tmp_path / "out"
    command = [sys.executable, str(EXAMPLES / script), "--output", str(output)]
    step, first, _resumed = first_then_resumed(
        command, tmp_path, None if between is None else between(output), released
    )
    assert first.count("saved:") == 1 and "deadline from daemon" in first
    assert checkpoints(output) == [step]  # still the only one: the resumed run saved none


@pytest.mark.frameworks
def test_torch_distributed_example_every_rank_saves_at_the_same_step(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    output = tmp_path / "out"
    command = [sys.executable, str(EXAMPLES / "torch_distributed.py"), "--nproc-per-node", "2",
               "--output", str(output)]
    step, first, resumed = first_then_resumed(command, tmp_path, released=EXIT_RELEASED)
    saved = re.findall(r"rank (\d): saved: checkpoint at step (\d+)", first)
    assert sorted(saved) == [("0", str(step)), ("1", str(step))], first[-3000:]
    assert sorted(re.findall(r"rank (\d): stop:", first)) == ["0", "1"]
    assert sorted(re.findall(r"rank (\d): start: resuming", resumed)) == ["0", "1"]
    listing = list_checkpoints(output)
    assert [(entry.step, entry.valid) for entry in listing] == [(step, True)]


@pytest.mark.frameworks
def test_dcp_example_every_rank_writes_its_shards_of_one_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    output = tmp_path / "out"
    command = [sys.executable, str(EXAMPLES / "torch_dcp.py"), "--nproc-per-node", "2",
               "--output", str(output)]
    step, first, resumed = first_then_resumed(command, tmp_path, released=EXIT_RELEASED)
    saved = re.findall(r"rank (\d): saved: checkpoint at step (\d+)", first)
    assert sorted(saved) == [("0", str(step)), ("1", str(step))], first[-3000:]
    # The asynchronous save was committed before the loop ended, on every rank.
    assert sorted(re.findall(r"rank (\d): committed: step (\d+)", first)) == [
        ("0", str(step)), ("1", str(step))], first[-3000:]
    assert sorted(re.findall(r"rank (\d): start: resuming", resumed)) == ["0", "1"]
    listing = list_checkpoints(output)
    assert [(entry.step, entry.valid) for entry in listing] == [(step, True)]
    files = {entry.path for entry in listing[0].info.files} if listing[0].info else set()
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= files, files


@pytest.mark.frameworks
@pytest.mark.parametrize(
    ("script", "needs"),
    [
        ("hf_trainer.py", ("torch", "transformers", "accelerate")),
        ("lightning_module.py", ("torch", "lightning")),
        ("torch_distributed.py", ("torch",)),
        ("torch_dcp.py", ("torch",)),
    ],
)
def test_help_lists_the_options(script: str, needs: tuple[str, ...], tmp_path: Path) -> None:
    for module in needs:
        pytest.importorskip(module)
    text = run([sys.executable, str(EXAMPLES / script), "--help"], "http://127.0.0.1:9", tmp_path)
    for option in ("--steps", "--output", "--release-in", "--save-seconds", "--redundant-seconds"):
        assert option in text


def readme_line(script: str) -> str:
    """The command line examples/README.md documents for ``script``, from its table."""
    text = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    found = re.findall(rf"^\| \[{re.escape(script)}\].*\| `(python examples/{re.escape(script)}"
                       r"[^`]*)` \|$", text, flags=re.MULTILINE)
    assert len(found) == 1, f"no single table line for {script} in examples/README.md"
    return found[0]


def as_written(line: str) -> list[str]:
    words = shlex.split(line)
    assert words[0] == "python"
    return [sys.executable, *words[1:]]


def dead_url() -> str:
    """A loopback port nobody listens on: no daemon."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


README_EXAMPLES = [
    pytest.param("plain_pytorch.py", (), r"step_(\d+)$", id="plain"),
    pytest.param("hf_trainer.py", ("torch", "transformers", "accelerate"), r"checkpoint-(\d+)$",
                 marks=pytest.mark.frameworks, id="hf"),
]


@pytest.mark.parametrize("daemon_running", [False, True], ids=["no-daemon", "daemon"])
@pytest.mark.parametrize(("script", "needs", "folder"), README_EXAMPLES)
def test_readme_line_runs_as_written_saves_stops_and_resumes(
    script: str, needs: tuple[str, ...], folder: str, daemon_running: bool, tmp_path: Path,
) -> None:
    """The README's line, word for word, from a working folder of its own: it follows
    ``--release-in`` (a daemon running with a deadline an hour away is not asked), saves,
    exits 75 and prints an existing checkpoint; the ``resume:`` line it prints resumes
    from that checkpoint, left in the folder, and finishes."""
    for module in needs:
        pytest.importorskip(module)
    (tmp_path / "examples").symlink_to(EXAMPLES)  # `python examples/...` as in the README
    line = readme_line(script)
    started = time.monotonic()
    if daemon_running:
        with serve_daemon(sources=("static",), expires_at=repr(time.time() + 3600)) as daemon:
            wait_for(lambda: daemon.store.health().ok)
            first = run(as_written(line), daemon.url, tmp_path, status=EXIT_RELEASED)
    else:
        first = run(as_written(line), dead_url(), tmp_path, status=EXIT_RELEASED)
    took = time.monotonic() - started
    assert re.search(r"^deadline: --release-in [\d.]+ s .*no daemon is asked$", first,
                     re.MULTILINE), first[-3000:]
    assert "deadline from env" in first, first[-3000:]
    paths = [Path(p) for p in re.findall(r"(?:checkpoint|->) (/[^\s;]+)", first)]
    assert paths and all(path.is_dir() for path in paths), first[-3000:]
    saved = paths[-1]
    assert saved.parent.resolve().is_relative_to(tmp_path.resolve())  # under ./checkpoints
    match = re.search(folder, str(saved))
    assert match is not None
    step = int(match.group(1))
    assert step >= 1, first[-3000:]  # trained before the save
    assert took < 60, f"{took:.0f} s: the documented line should take about 30"

    resume = re.findall(r"^resume: (python .*)$", first, re.MULTILINE)
    assert len(resume) == 1, first[-3000:]
    total = step + 50
    assert resume[0].endswith(f"--steps {total}")
    resumed = run(as_written(resume[0]), dead_url(), tmp_path)
    assert "deadline: the daemon's at" in resumed, resumed[-3000:]
    if script == "hf_trainer.py":
        assert f"start: resuming from step {step}" in resumed, resumed[-3000:]
        assert f"done: trained {total}/{total} steps" in resumed, resumed[-3000:]
    else:
        assert f"training steps {step + 1} to {total - 1}" in resumed, resumed[-3000:]
        assert f"ran to step {total}/{total}" in resumed, resumed[-3000:]
    assert saved.is_dir()  # still there: nothing removed it at exit


def test_plain_example_help_says_release_in_wins_and_keeps_checkpoints_alias(
    tmp_path: Path,
) -> None:
    text = run([sys.executable, str(EXAMPLES / "plain_pytorch.py"), "--help"], dead_url(),
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
