"""A real Hugging Face Trainer (tiny GPT-2 from a config, CPU) with EsiCheckpointCallback.

The daemon knows a release 950 simulated seconds ahead; the guard's wall clock advances
100 s per optimizer step (real step durations are milliseconds). With save 30 s and
redundant 40 s, the budget is about 70 s: remaining = 950 - 100 k <= 70 first at k = 9.
The Trainer's own saving is off (save_strategy="no"), so checkpoint-9 can only be ours.
"""

from __future__ import annotations

import inspect
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import pytest
from daemon_harness import serve_daemon, wait_for
from drill_support import DrillScript
from rank_launcher import run_framework_ranks

from sidecar.train.client import SidecarClient
from sidecar.train.guard import CheckpointGuard
from sidecar.train.policy import SavePolicy

pytest.importorskip("torch")
pytest.importorskip("transformers")
# The Trainer refuses to run without accelerate (transformers[torch]); the frameworks
# extra must list it, or these tests are skipped here.
pytest.importorskip("accelerate")

import torch
import transformers

pytestmark = pytest.mark.frameworks

RELEASE_AFTER = 950
WALL_SECONDS_PER_STEP = 100
EXPECTED_SAVE_STEP = 9
MAX_STEPS = 20


class TinyDataset(torch.utils.data.Dataset[dict[str, Any]]):
    def __init__(self, size: int = 64, length: int = 8) -> None:
        generator = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, 64, (size, length), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def train(
    tmp_path: Path, url: str, base_unix: float, stop_after_save: bool, by_policy: bool = False,
    top_up: Optional[float] = None, straggler: Optional[int] = None,
) -> tuple[Any, Any]:
    """One run; ``by_policy``: the callback gets policy= and guard options, not guard=.

    ``top_up``: the top-up margin (None: none, the save-once-and-stop tests). With one,
    steps and saves are timed on the simulated clock too (a step takes its 100 s), so
    that whether a top-up fits is decided on the same time the release uses.
    ``straggler``: that optimizer step takes 120 s more."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from sidecar.integrations.transformers import EsiCheckpointCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    )
    holder: dict[str, Any] = {}

    def clock() -> float:  # simulated wall time: 100 s per completed optimizer step
        trainer = holder.get("trainer")
        step = 0 if trainer is None else trainer.state.global_step
        late = 120 if straggler is not None and step >= straggler else 0
        return base_unix + WALL_SECONDS_PER_STEP * step + late

    policy = SavePolicy(save_seconds=30, redundant_seconds=40, top_up_seconds=top_up)
    timing: dict[str, Any] = {} if top_up is None else {"monotonic": clock}
    if by_policy:
        # The simulated clock only moves with training steps: the guard answers the stop
        # at once rather than wait for the release (test_release_wait.py covers the wait).
        callback = EsiCheckpointCallback(
            stop_after_save=stop_after_save, policy=policy, client=SidecarClient(url),
            clock=clock, wait_for_release=False,
        )
        assert callback.guard is None  # built in on_train_begin
    else:
        guard = CheckpointGuard(client=SidecarClient(url), policy=policy, clock=clock,
                                wait_for_release=False, **timing)
        callback = EsiCheckpointCallback(guard=guard, stop_after_save=stop_after_save,
                                         **timing)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        max_steps=MAX_STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(), callbacks=[callback])
    holder["trainer"] = trainer
    trainer.train()
    return trainer, callback


@pytest.fixture
def daemon_url() -> Any:
    base_unix = float(int(time.time()))
    with serve_daemon(sources=("static",), expires_at=str(int(base_unix) + RELEASE_AFTER)) as d:
        wait_for(lambda: d.store.health().ok)
        yield d.url, base_unix


@pytest.mark.parametrize("by_policy", [False, True], ids=["guard", "policy"])
def test_saves_once_then_stops(
    tmp_path: Path, daemon_url: tuple[str, float], by_policy: bool
) -> None:
    url, base_unix = daemon_url
    trainer, callback = train(tmp_path, url, base_unix, stop_after_save=True, by_policy=by_policy)

    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [f"checkpoint-{EXPECTED_SAVE_STEP}"]
    checkpoint = out / f"checkpoint-{EXPECTED_SAVE_STEP}"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == EXPECTED_SAVE_STEP
    assert any(p.name.startswith("model") for p in checkpoint.iterdir())
    assert (checkpoint / "optimizer.pt").exists()

    assert trainer.state.global_step == EXPECTED_SAVE_STEP  # stopped right after the save
    assert callback.saves_requested == 1 and callback.saves_recorded == 1
    assert callback.stopped is True
    assert callback.guard.policy.measured_save_estimate() is not None  # the save was timed
    assert callback.guard.policy.redundant_seconds == 40


def test_top_up_save_after_the_final_one_then_stops(
    tmp_path: Path, daemon_url: tuple[str, float]
) -> None:
    # Steps take 100 s: the final save at step 8 (150 s left <= 100 + 30 + 40). The save
    # takes no simulated time, so 150 s > a step + the save + a 0 s margin: train step
    # 9 and save again there (50 s left), then stop.
    url, base_unix = daemon_url
    trainer, callback = train(tmp_path, url, base_unix, stop_after_save=True, top_up=0.0)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-8", "checkpoint-9"]
    assert trainer.state.global_step == 9
    assert callback.saves_requested == 2 and callback.saves_recorded == 2
    assert callback.stopped is True
    status = callback.guard.status()
    assert (status.final_step, status.top_up_step) == (8, 9)


def test_a_top_up_that_no_longer_fits_stops_without_a_save(
    tmp_path: Path, daemon_url: tuple[str, float]
) -> None:
    # Step 9 straggles (220 s): the release has passed when it ends, so no top-up save
    # is started and training stops there, not at max_steps.
    url, base_unix = daemon_url
    trainer, callback = train(tmp_path, url, base_unix, stop_after_save=True, top_up=0.0,
                              straggler=9)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-8"]
    assert trainer.state.global_step == 9
    assert callback.saves_requested == 1 and callback.stopped is True


def test_guard_with_policy_or_options_is_refused() -> None:
    from sidecar.integrations.transformers import EsiCheckpointCallback

    guard = CheckpointGuard(client=SidecarClient("http://127.0.0.1:9"))
    with pytest.raises(ValueError, match="either guard= or policy="):
        EsiCheckpointCallback(guard=guard, policy=SavePolicy())
    with pytest.raises(ValueError, match="client"):
        EsiCheckpointCallback(guard=guard, client=SidecarClient("http://127.0.0.1:9"))
    with pytest.raises(TypeError, match="'polcy'"):
        EsiCheckpointCallback(polcy=SavePolicy())  # a typo fails here, not in train()
    callback = EsiCheckpointCallback(policy=SavePolicy(), refresh_seconds=5)
    assert callback.guard is None and callback.policy is not None


def test_without_stop_trains_on_and_still_saves_once(
    tmp_path: Path, daemon_url: tuple[str, float]
) -> None:
    """Once per deadline: verl's seed rule would save again at every later step."""
    url, base_unix = daemon_url
    trainer, callback = train(tmp_path, url, base_unix, stop_after_save=False)

    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [f"checkpoint-{EXPECTED_SAVE_STEP}"]
    assert trainer.state.global_step == MAX_STEPS
    assert callback.saves_requested == 1
    assert callback.stopped is False


def test_resume_from_our_checkpoint(tmp_path: Path, daemon_url: tuple[str, float]) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from sidecar.integrations.transformers import GUARD_STATE_FILE, EsiCheckpointCallback

    url, base_unix = daemon_url
    train(tmp_path, url, base_unix, stop_after_save=True)
    checkpoint = tmp_path / "out" / f"checkpoint-{EXPECTED_SAVE_STEP}"

    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    )
    args = TrainingArguments(
        output_dir=str(tmp_path / "resumed"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        max_steps=EXPECTED_SAVE_STEP + 2,
        per_device_train_batch_size=2,
    )
    saved = json.loads((checkpoint / GUARD_STATE_FILE).read_text())
    assert len(saved["policy"]["steps"]) == EXPECTED_SAVE_STEP  # travels with checkpoint-N
    # The resumed run's callback reads it from the folder it resumes from.
    fresh = EsiCheckpointCallback(client=SidecarClient(url), wait_for_release=False)
    resumed_from = tmp_path / "resumed" / checkpoint.name
    shutil.copytree(checkpoint, resumed_from)
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(), callbacks=[fresh])
    trainer.train(resume_from_checkpoint=str(resumed_from))
    assert trainer.state.global_step == EXPECTED_SAVE_STEP + 2
    assert fresh.restored_from == str(resumed_from / GUARD_STATE_FILE)


def test_the_callback_is_an_ordinary_class_of_the_module() -> None:
    """Defined at the module's top (what IDEs and mypy read), not built by a ``__getattr__``."""
    import sidecar.integrations.transformers as module

    cls = module.EsiCheckpointCallback
    assert inspect.isclass(cls) and vars(module)["EsiCheckpointCallback"] is cls
    assert not hasattr(module, "__getattr__")
    assert issubclass(cls, transformers.TrainerCallback)
    assert cls is module.EsiCheckpointCallback  # built once
    assert cls.__module__ == "sidecar.integrations.transformers"
    with pytest.raises(AttributeError):
        _ = module.NoSuchThing


def test_two_processes_agree_with_the_default_guard(tmp_path: Path) -> None:
    """2 ranks (gloo), each with its own daemon; only rank 0's knows a near release.

    The callback's default guard picks up the TorchReducer by itself: both ranks request
    the save at the first step, both take part in it (each writes its RNG state), both
    stop there. Each rank's own view still differs (rank-local remaining time).
    """
    results = run_framework_ranks("hf", tmp_path)
    for r in results:
        assert r["distributed"] is True and r["world_size"] == 2
        assert r["saves"] == 1 and r["saves_recorded"] == 1
        assert r["stopped"] is True
        assert r["global_step"] == 1
    assert results[0]["local_remaining"] < 200 < 10**5 < results[1]["local_remaining"]
    checkpoints = [p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint-")]
    assert checkpoints == ["checkpoint-1"]
    files = {p.name for p in (tmp_path / "checkpoint-1").iterdir()}
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= files


def test_latest_complete_checkpoint_skips_interrupted_saves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The Trainer writes trainer_state.json last; a folder without a whole one is a save
    that a kill cut short, and get_last_checkpoint would still pick it."""
    from transformers.trainer_utils import get_last_checkpoint

    from sidecar.integrations.transformers import latest_complete_checkpoint

    def checkpoint(step: int, state: str | None) -> Path:
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"weights")
        if state is not None:
            (folder / "trainer_state.json").write_text(state)
        return folder

    assert latest_complete_checkpoint(tmp_path / "missing") is None
    assert latest_complete_checkpoint(tmp_path) is None
    good = checkpoint(5, json.dumps({"global_step": 5}))
    checkpoint(7, None)  # killed before the state was written
    checkpoint(8, '{"global_step": 8, "log_hist')  # killed while writing it
    checkpoint(9, json.dumps({"global_step": 3}))  # a copied or renamed folder
    (tmp_path / "checkpoint-10").write_text("not a folder")
    assert get_last_checkpoint(str(tmp_path)).endswith("checkpoint-9")
    assert latest_complete_checkpoint(tmp_path) == str(good)
    assert caplog.text.count("skipping") == 3


def test_a_fire_drill_saves_through_the_trainers_own_save_and_training_goes_on(
    tmp_path: Path,
) -> None:
    """A drill served by the real daemon: the Trainer writes checkpoint-N through its own
    save, the daemon records PASS, and training goes on in the same process (no stop)."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from sidecar.integrations.transformers import EsiCheckpointCallback

    with serve_daemon(sources=("static",), expires_at=repr(time.time() + 3600)) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        script = DrillScript(daemon.url, lead=4.0)

        class Pace(TrainerCallback):  # type: ignore[misc]
            """Steps of 50 ms (the model's take microseconds); the drill's script."""

            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
                time.sleep(0.05)  # the training step itself

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
                if script.at_step(state.global_step):
                    control.should_training_stop = True  # the test's end, not the guard's

        callback = EsiCheckpointCallback(
            policy=SavePolicy(save_seconds=0.5, redundant_seconds=1.0, top_up_seconds=None),
            client=SidecarClient(daemon.url), refresh_seconds=0.05, environ={})
        torch.manual_seed(0)
        model = GPT2LMHeadModel(
            GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="no",
            eval_strategy="no", logging_strategy="no", disable_tqdm=True, max_steps=2000,
            per_device_train_batch_size=2, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(),
                          callbacks=[callback, Pace()])
        trainer.train()
    assert script.passed(), script.verdicts
    step = script.verdicts[0]["figures"]["step"]
    assert callback.saves_requested == 1 and callback.stopped is False
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"checkpoint-{step}"]
    state = json.loads((tmp_path / "out" / f"checkpoint-{step}" / "trainer_state.json")
                       .read_text())
    assert state["global_step"] == step
    assert trainer.state.global_step == script.end_step > step  # trained on past the drill


class Lines(logging.Handler):
    """What one logger says (transformers' loggers do not reach the root, so not caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_resume_says_nothing_of_tied_keys_and_warns_of_truly_missing_ones(
    tmp_path: Path, daemon_url: tuple[str, float]
) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from sidecar.integrations.transformers import EsiCheckpointCallback

    url, _base_unix = daemon_url

    def trainer(steps: int) -> Any:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(  # lm_head.weight is tied to transformer.wte.weight
            GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], save_strategy="steps",
            save_steps=2, logging_strategy="no", disable_tqdm=True, max_steps=steps,
            per_device_train_batch_size=2)
        callback = EsiCheckpointCallback(client=SidecarClient(url), wait_for_release=False)
        return Trainer(model=model, args=args, train_dataset=TinyDataset(), callbacks=[callback])

    trainer(2).train()
    said = Lines()
    warnings = logging.getLogger("transformers.trainer")
    warnings.addHandler(said)
    try:
        resumed = trainer(3)
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
        assert resumed.state.global_step == 3
        assert not any("missing keys" in line for line in said.lines), said.lines
        # A key truly missing is still said, without the tied one beside it.
        warnings.warning("There were missing keys in the checkpoint model loaded: "
                         "['lm_head.weight', 'transformer.ln_f.bias'].")
    finally:
        warnings.removeHandler(said)
    assert said.lines == ["There were missing keys in the checkpoint model loaded: "
                          "['transformer.ln_f.bias']."], said.lines
