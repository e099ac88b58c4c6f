"""The verl integration against the real verl releases (``make test`` installs 0.9.1 and
0.8.0 with ``--no-deps`` into ``.venv/verl/<version>``, plus ray and the light packages
their trainer modules import; no GPU stack).

What is pinned here, per release: the function's signature and rule, every module that
imports ``should_save_ckpt_esi`` (a new call site fails a test that names it), the config
keys docs/integrations.md tells users to set, ``install()``/``uninstall()`` in both import
orders, and, on 0.9, verl's own V1 loop driven with stub workers: it saves once before an
emulated release, then leaves.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemon_harness import serve_daemon, wait_for
from drill_support import job_heard, start_drill, verdict

from sidecar.integrations.verl import should_save_ckpt_esi

REPO = Path(__file__).resolve().parents[2]
VERSIONS = ("0.9.1", "0.8.0")
# Every module of each release that imports the function by name: the drop-in must be
# bound there. A release that adds or moves one makes the call-site test fail.
CALL_SITES = {
    "0.9.1": {"verl.trainer.ppo.ray_trainer",
              "verl.experimental.fully_async_policy.fully_async_trainer",
              "verl.experimental.separation.ray_trainer"},
    "0.8.0": {"verl.trainer.ppo.ray_trainer",
              "verl.experimental.fully_async_policy.fully_async_trainer",
              "verl.experimental.separation.ray_trainer"},
}


def wheel(version: str) -> Path:
    root = Path(sys.prefix) / "verl" / version
    if not (root / "verl").is_dir():
        pytest.skip(f"verl {version} is not installed in {root} (make test installs it)")
    return root


def run_python(version: str, code: str, env: dict[str, str] | None = None,
               timeout: float = 300) -> Any:
    """Run ``code`` with that verl release importable; its last stdout line is JSON."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=timeout, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(wheel(version)), **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("version", VERSIONS)
def test_the_signature_is_verls(version: str) -> None:
    source = (wheel(version) / "verl/utils/checkpoint/checkpoint_manager.py").read_text()
    tree = ast.parse(source)
    (function,) = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                   and node.name == "should_save_ckpt_esi"]
    theirs = [(a.arg, ast.literal_eval(d) if d is not None else inspect.Parameter.empty)
              for a, d in zip(function.args.args, [None] * (
                  len(function.args.args) - len(function.args.defaults))
                  + list(function.args.defaults))]
    ours = [(p.name, p.default) for p in inspect.signature(should_save_ckpt_esi)
            .parameters.values()]
    assert theirs == ours


@pytest.mark.parametrize("version", VERSIONS)
def test_every_call_site_is_known(version: str) -> None:
    root = wheel(version)
    found = set()
    for path in (root / "verl").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any(
                    alias.name == "should_save_ckpt_esi" for alias in node.names):
                found.add(".".join(path.relative_to(root).with_suffix("").parts))
    assert found == CALL_SITES[version], (
        f"verl {version} imports should_save_ckpt_esi into {sorted(found)}, the tests know "
        f"{sorted(CALL_SITES[version])}: a call site was added or moved; check that "
        "install() still binds the drop-in there, then update CALL_SITES")


@pytest.mark.parametrize("version", VERSIONS)
def test_the_config_keys_the_docs_name_exist(version: str) -> None:
    config = yaml.safe_load((wheel(version) / "verl/trainer/config/_generated_ppo_trainer.yaml")
                            .read_text())
    trainer = config["trainer"]
    assert {"esi_redundant_time", "save_freq", "default_local_dir"} <= set(trainer)
    # `+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=...` reaches ray.init:
    # main_ppo merges ray_kwargs.ray_init.runtime_env into the runtime_env it starts Ray with.
    assert "ray_init" in config["ray_kwargs"]
    main = (wheel(version) / "verl/trainer/main_ppo.py").read_text()
    assert 'ray_init_kwargs.get("runtime_env"' in main and "ray.init(" in main, (
        f"verl {version} no longer takes ray_kwargs.ray_init.runtime_env: the documented "
        "worker_process_setup_hook override would be ignored")
    if version.startswith("0.9"):
        assert trainer["use_v1"] is True  # the V1 loop is the default there


def test_the_v1_loop_exists_as_the_hook_expects() -> None:
    """PPOTrainer.fit calls self.step() then the save_freq save; no V1 trainer overrides
    step(). A release that changes this makes the hook miss: this test says so."""
    root = wheel("0.9.1") / "verl/trainer/ppo/v1"
    base = ast.parse((root / "trainer_base.py").read_text())
    (trainer,) = [n for n in base.body if isinstance(n, ast.ClassDef) and n.name == "PPOTrainer"]
    methods = {n.name: n for n in trainer.body if isinstance(n, ast.FunctionDef)}
    assert "step" in methods and "_save_checkpoint" in methods
    fit = ast.unparse(methods["fit"])
    assert "self.step(" in fit and "self._save_checkpoint()" in fit
    assert fit.index("self.step(") < fit.index("self._save_checkpoint()")
    assert "self.global_steps <= self.total_training_steps" in fit, "the loop's exit moved"
    for path in set(root.glob("trainer_*.py")) - {root / "trainer_base.py"}:
        classes = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)]
        for cls in classes:
            overrides = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
            assert "step" not in overrides, f"{path.name}:{cls.name} overrides step()"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("order", ["install-first", "import-first"])
def test_install_binds_the_drop_in_everywhere_and_uninstall_restores(
        version: str, order: str) -> None:
    answer = run_python(version, f"""
        import json, sys
        from sidecar.integrations import verl as esi_verl
        ours = esi_verl.should_save_ckpt_esi
        if {order == "install-first"!r}:
            assert esi_verl.install() is True
        import verl.trainer.ppo.ray_trainer as ray_trainer
        import verl.experimental.separation.ray_trainer as separation
        import verl.utils.checkpoint.checkpoint_manager as manager
        v1 = None
        try:
            from verl.trainer.ppo.v1 import trainer_base as v1
        except ImportError:
            pass
        if {order == "import-first"!r}:
            assert esi_verl.install() is True
        bound = [m.should_save_ckpt_esi is ours for m in (ray_trainer, separation, manager)]
        wrapped = v1 is not None and hasattr(v1.PPOTrainer.step, "__esi_sidecar_wrapped__")
        esi_verl.uninstall()
        restored = [m.should_save_ckpt_esi is manager.should_save_ckpt_esi
                    and m.should_save_ckpt_esi is not ours
                    for m in (ray_trainer, separation, manager)]
        unwrapped = v1 is None or not hasattr(v1.PPOTrainer.step, "__esi_sidecar_wrapped__")
        print(json.dumps({{"bound": bound, "wrapped": wrapped, "restored": restored,
                          "unwrapped": unwrapped, "v1": v1 is not None}}))
    """)
    assert answer["bound"] == [True, True, True]
    assert answer["restored"] == [True, True, True]
    assert answer["v1"] is version.startswith("0.9")
    assert answer["wrapped"] is answer["v1"] and answer["unwrapped"] is True


@pytest.mark.parametrize("version", VERSIONS)
def test_the_drop_in_answers_like_verls_mlp_branch(version: str) -> None:
    """Same answers as verl's own function, given the same deadline in
    MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP (the daemon knows none)."""
    answer = run_python(version, """
        import json, os, socket, time
        from verl.utils.checkpoint.checkpoint_manager import should_save_ckpt_esi as theirs
        from sidecar.integrations.verl import configure, should_save_ckpt_esi as ours
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        cases = []
        for remaining in (-30, 50, 100, 10**5):
            os.environ["MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"] = str(
                time.time() + remaining)
            configure(f"http://127.0.0.1:{port}")
            for step in (0, 10, 50):
                for save, margin in ((60, 0), (10, 5)):
                    cases.append([theirs(step, save, margin), ours(step, save, margin)])
        print(json.dumps(cases))
    """)
    assert len(answer) == 24
    assert [theirs for theirs, _ in answer] == [ours for _, ours in answer]


def test_the_sagemaker_branch_differs_where_verl_saves_too_late_and_the_drop_in_does_not(
) -> None:
    """verl's SAGEMAKER_... branch says True after the deadline and before a step was
    measured; the drop-in does not (a save that starts after the release is lost)."""
    answer = run_python("0.9.1", """
        import json, os, socket, time
        from verl.utils.checkpoint.checkpoint_manager import should_save_ckpt_esi as theirs
        from sidecar.integrations.verl import configure, should_save_ckpt_esi as ours
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        os.environ.pop("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", None)
        out = {}
        for name, remaining, step in (("past", -30, 10), ("no step", 50, 0), ("inside", 50, 10)):
            os.environ["SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"] = str(
                int(time.time() + remaining))
            configure(f"http://127.0.0.1:{port}")
            out[name] = [theirs(step, 60, 0), ours(step, 60, 0)]
        print(json.dumps(out))
    """)
    assert answer == {"past": [True, False], "no step": [True, False], "inside": [True, True]}


def run_v1_loop(save_freq: int, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, str, float,
                                                                        float]:
    """verl 0.9.1's own fit() and step(), workers stubbed
    (tests/integrations/verl_wheels/v1_loop.py): steps
    of 0.3 s, saves of 0.2 s (``trainer.esi_save_seconds`` 0.2), margin 2 s
    (``trainer.esi_redundant_time``), an emulated ESI release 8 s after training starts.
    Returns (what the loop did, its log, the release time, when it ended)."""
    from sidecar.tools.emulator import Emulator

    monkeypatch.setenv("VOLCENGINE_ACCESS_KEY", "AKLTverltest0001")
    monkeypatch.setenv("VOLCENGINE_SECRET_KEY", "verl-test-secret")
    with Emulator(access_key="AKLTverltest0001", secret_key="verl-test-secret") as emu:
        emu.set_release_in(3600)
        with serve_daemon(api_endpoint=emu.url, metadata_url=emu.url) as daemon:
            wait_for(lambda: daemon.store.health().ok)
            process = subprocess.Popen(
                [sys.executable, str(REPO / "tests/integrations/verl_wheels/v1_loop.py"), "200",
                 "0.3", "0.2", str(save_freq), "install-first"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(wheel("0.9.1")),
                     "ESI_SIDECAR_URL": daemon.url})
            try:
                assert process.stdout is not None and process.stdin is not None
                assert process.stdout.readline().strip() == "READY"
                release = time.time() + 8.0
                emu.set_release_in(8.0)
                wait_for(lambda: (daemon.store.expiry().remaining_seconds or 99) < 9)
                process.stdin.write("go\n")
                process.stdin.flush()
                out, err = process.communicate(timeout=120)
                ended = time.time()
            finally:
                if process.poll() is None:
                    process.kill()
    assert process.returncode == 0, err[-3000:]
    answer = json.loads(out.strip().splitlines()[-1])
    assert answer["wrapped"] is True
    assert answer["released"] is True, (answer, err[-2000:])
    assert len(answer["steps_run"]) < 200  # it left at the release, not at the end
    assert ended >= release - 1.0, answer  # it waited for the release, not left early
    assert "ending verl's training loop" in err
    return answer, err, release, ended


def test_verls_v1_loop_saves_once_before_the_release_and_leaves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    answer, _err, _release, _ended = run_v1_loop(save_freq=0, monkeypatch=monkeypatch)
    final = answer["final_step"]
    # One final save (and a top-up right after it when one fits), nothing trained after.
    assert final is not None and answer["saves"][0] == final, answer
    assert answer["saves"] in ([final], [final, final + 1]), answer
    assert answer["steps_run"][-1] == answer["saves"][-1]


def test_with_verls_save_freq_no_step_is_saved_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    answer, _err, _release, _ended = run_v1_loop(save_freq=3, monkeypatch=monkeypatch)
    saves = answer["saves"]
    assert len(saves) == len(set(saves)), answer
    assert [s for s in saves if s % 3] in ([], [saves[-1]], saves[-2:]), answer
    # A save inside the rule's window (a save_freq one counts) covers this release.
    assert "saved for this deadline" in answer["reason"]
    assert answer["steps_run"][-1] <= saves[-1] + 1, answer


def test_a_fire_drill_in_verls_v1_loop_saves_once_and_the_loop_runs_to_its_end() -> None:
    """verl 0.9.1's own fit() and step() (stub workers, steps of 0.1 s, saves of 0.2 s):
    a drill served by the real daemon is saved for once through the trainer's
    ``_save_checkpoint``, the daemon records PASS, and the loop trains on to its last step."""
    wheel("0.9.1")
    with serve_daemon(sources=("static",), expires_at=repr(time.time() + 3600)) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        process = subprocess.Popen(
            [sys.executable, str(REPO / "tests/integrations/verl_wheels/v1_loop.py"), "80",
             "0.1", "0.2", "0", "install-first"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(wheel("0.9.1")), str(REPO)]),
                 "ESI_SIDECAR_URL": daemon.url})
        try:
            assert process.stdout is not None and process.stdin is not None
            assert process.stdout.readline().strip() == "READY"
            process.stdin.write("go\n")
            process.stdin.flush()
            wait_for(lambda: job_heard(daemon.url), timeout=30, interval=0.05)
            drill = start_drill(daemon.url, 5.0)
            out, err = process.communicate(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
        decided = wait_for(lambda: verdict(daemon.url, drill["id"]), timeout=10)
    assert process.returncode == 0, err[-3000:]
    answer = json.loads(out.strip().splitlines()[-1])
    assert decided["verdict"] == "PASS", (decided, err[-2000:])
    assert answer["saves"] == [decided["figures"]["step"]], answer
    assert answer["released"] is False and answer["steps_run"][-1] == 80, answer
