"""Routine saves through the frameworks' own save paths, where no notice can hold a save:
a real Hugging Face Trainer, a real lightning.Trainer and verl's ``should_save_ckpt_esi``
drop-in, each against the real daemon (issue 23, item 6).

The daemon's static source declares a 30 s notice (``--notice static=30``) and a release
10 h away, so the rule itself never saves. The guard's clocks are simulated: 100 s per
optimizer step and 30 s per checkpoint written. A step + save (130 s) does not fit in 30 s:
routine saves every sqrt(2 x 30 s x 6 h) = 1138 s, counted from the first decision (after
step 1, at 100 s): the first at step 13 (1300 s). Measured, the save is 30 s x 1.2: the
next would be 1247 s after step 13, past the 20 steps.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from daemon_harness import serve_daemon, wait_for

from sidecar.train.client import SidecarClient
from sidecar.train.guard import CheckpointGuard
from sidecar.train.policy import SavePolicy

pytest.importorskip("torch")

import torch

pytestmark = pytest.mark.frameworks

MAX_STEPS = 20
STEP_SECONDS = 100
SAVE_SECONDS = 30
ROUTINE_STEP = 13  # 100 + sqrt(2 x 30 x 21600) = 1238 s: the first step past it


def test_the_expected_step_is_the_young_daly_interval() -> None:
    assert math.ceil((STEP_SECONDS + math.sqrt(2 * SAVE_SECONDS * 6 * 3600)) / STEP_SECONDS) \
        == ROUTINE_STEP


@pytest.fixture
def daemon_url() -> Any:
    with serve_daemon(sources=("static",), expires_at=str(int(time.time()) + 36000),
                      notices={"static": 30.0}) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        yield daemon.url


def simulated_clock(base: float, steps: Callable[[], int], saves: Callable[[], int]
                    ) -> Callable[[], float]:
    return lambda: base + STEP_SECONDS * steps() + SAVE_SECONDS * saves()


def guard_for(url: str, clock: Callable[[], float], routine: object) -> CheckpointGuard:
    policy = SavePolicy(save_seconds=SAVE_SECONDS, routine_seconds=routine)  # type: ignore[arg-type]
    return CheckpointGuard(client=SidecarClient(url), policy=policy, clock=clock,
                           monotonic=clock, wait_for_release=False, environ={}, events=False)


# ---------------------------------------------------------------------------- Hugging Face


def hf_train(tmp_path: Path, url: str, routine: object) -> list[str]:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from sidecar.integrations.transformers import EsiCheckpointCallback

    class Rows(torch.utils.data.Dataset[dict[str, Any]]):
        rows = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, index: int) -> dict[str, Any]:
            return {"input_ids": self.rows[index], "labels": self.rows[index]}

    out = tmp_path / "out"
    holder: dict[str, Any] = {}
    clock = simulated_clock(
        float(int(time.time())),
        lambda: 0 if "trainer" not in holder else holder["trainer"].state.global_step,
        lambda: len(list(out.glob("checkpoint-*"))))
    callback = EsiCheckpointCallback(guard=guard_for(url, clock, routine), monotonic=clock)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                       n_positions=16))
    args = TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[],
                             save_strategy="no", eval_strategy="no", logging_strategy="no",
                             disable_tqdm=True, max_steps=MAX_STEPS,
                             per_device_train_batch_size=2, dataloader_num_workers=0)
    trainer = holder["trainer"] = Trainer(model=model, args=args, train_dataset=Rows(),
                                          callbacks=[callback])
    trainer.train()
    assert trainer.state.global_step == MAX_STEPS  # a routine save never stops training
    return sorted(p.name for p in out.glob("checkpoint-*"))


def test_hugging_face_makes_the_routine_save_through_its_own_save(
        tmp_path: Path, daemon_url: str) -> None:
    assert hf_train(tmp_path, daemon_url, "auto") == [f"checkpoint-{ROUTINE_STEP}"]


def test_hugging_face_without_routine_saves_saves_nothing_as_before(
        tmp_path: Path, daemon_url: str) -> None:
    assert hf_train(tmp_path, daemon_url, None) == []


# ---------------------------------------------------------------------------- Lightning


def lightning_fit(tmp_path: Path, url: str, routine: object) -> list[str]:
    pytest.importorskip("lightning")
    import lightning.pytorch as pl
    from tiny_lightning import TinyModule as Tiny

    from sidecar.integrations.lightning import EsiCheckpointCallback

    folder = tmp_path / "ckpt"
    holder: dict[str, Any] = {}
    clock = simulated_clock(
        float(int(time.time())),
        lambda: 0 if "trainer" not in holder else holder["trainer"].global_step,
        lambda: len(list(folder.glob("*.ckpt"))))
    callback = EsiCheckpointCallback(folder, guard=guard_for(url, clock, routine),
                                     monotonic=clock)
    trainer = holder["trainer"] = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=MAX_STEPS, enable_progress_bar=False,
        enable_model_summary=False, logger=False, enable_checkpointing=False,
        default_root_dir=str(tmp_path), callbacks=[callback])
    inputs = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    torch.manual_seed(0)
    trainer.fit(Tiny(), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=4))
    assert trainer.global_step == MAX_STEPS and not callback.stopped
    return sorted(p.name for p in folder.glob("*.ckpt"))


def test_lightning_makes_the_routine_save_through_its_own_save(
        tmp_path: Path, daemon_url: str) -> None:
    # 16 batches per epoch: step 13 is in epoch 0.
    assert lightning_fit(tmp_path, daemon_url, "auto") == [f"esi-epoch=0-step={ROUTINE_STEP}.ckpt"]


def test_lightning_without_routine_saves_saves_nothing_as_before(
        tmp_path: Path, daemon_url: str) -> None:
    assert lightning_fit(tmp_path, daemon_url, None) == []


# ---------------------------------------------------------------------------- verl


@pytest.mark.parametrize("routine", ["auto", None])
def test_the_verl_drop_in_answers_true_for_routine_saves(daemon_url: str, routine: object) -> None:
    from sidecar.integrations import verl as esi_verl

    base = float(int(time.time()))
    now = [base]
    esi_verl.configure(daemon_url, environ={}, clock=lambda: now[0], monotonic=lambda: now[0],
                       routine_seconds=routine)  # type: ignore[arg-type]
    try:
        trues = []
        for step in range(1, 31):  # verl asks after every step; a True is its save
            now[0] = base + STEP_SECONDS * step
            if esi_verl.should_save_ckpt_esi(STEP_SECONDS, SAVE_SECONDS, 0):
                trues.append(step)
        # verl's save time is its fixed argument (30 s), not measured: the same interval
        # again after the routine save at step 13: 1300 + 1138 s, step 25.
        assert trues == ([] if routine is None else [ROUTINE_STEP, 25])
    finally:
        esi_verl.configure(environ={})
