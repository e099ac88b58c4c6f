"""A real lightning.Trainer (CPU, tiny LightningModule) with EsiCheckpointCallback.

Same numbers as the Hugging Face test: release 950 simulated seconds ahead, the guard's
clock advancing 100 s per optimizer step, save 30 s + redundant 40 s: the save happens
at global step 9, and training stops there. With gradient accumulation the decision is
taken per optimizer step, not per batch, so the answer is the same step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import serve_daemon, wait_for
from rank_launcher import run_framework_ranks

from sidecar.client import CheckpointGuard, SidecarClient
from sidecar.policy import SavePolicy

pytest.importorskip("torch")
pytest.importorskip("lightning")

import lightning.pytorch as pl
import torch

pytestmark = pytest.mark.frameworks

RELEASE_AFTER = 950
WALL_SECONDS_PER_STEP = 100
EXPECTED_SAVE_STEP = 9
MAX_STEPS = 20


class TinyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.layer(inputs), targets)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader() -> Any:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 4, generator=generator)
    dataset = torch.utils.data.TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    return torch.utils.data.DataLoader(dataset, batch_size=4)


def make_trainer(root: Path, max_steps: int, callbacks: list[Any], accumulate: int = 1) -> Any:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=str(root),
        callbacks=callbacks,
    )


@pytest.fixture
def daemon_url() -> Any:
    base_unix = float(int(time.time()))
    with serve_daemon(sources=("static",), expires_at=str(int(base_unix) + RELEASE_AFTER)) as d:
        wait_for(lambda: d.store.health().ok)
        yield d.url, base_unix


def train(
    tmp_path: Path, url: str, base_unix: float, *, accumulate: int = 1, stop: bool = True
) -> tuple[Any, Any]:
    from sidecar.integrations.lightning import EsiCheckpointCallback

    holder: dict[str, Any] = {}

    def clock() -> float:  # simulated wall time: 100 s per completed optimizer step
        trainer = holder.get("trainer")
        return base_unix + WALL_SECONDS_PER_STEP * (0 if trainer is None else trainer.global_step)

    guard = CheckpointGuard(
        client=SidecarClient(url),
        policy=SavePolicy(save_seconds=30, redundant_seconds=40),
        clock=clock,
    )
    callback = EsiCheckpointCallback(tmp_path / "ckpt", guard=guard, stop_after_save=stop)
    trainer = make_trainer(tmp_path, MAX_STEPS, [callback], accumulate=accumulate)
    holder["trainer"] = trainer
    torch.manual_seed(0)
    trainer.fit(TinyModule(), train_dataloaders=loader())
    return trainer, callback


@pytest.mark.parametrize("accumulate", [1, 2])
def test_saves_once_then_stops(
    tmp_path: Path, daemon_url: tuple[str, float], accumulate: int
) -> None:
    url, base_unix = daemon_url
    trainer, callback = train(tmp_path, url, base_unix, accumulate=accumulate)

    epoch = EXPECTED_SAVE_STEP * accumulate // 16  # 16 batches per epoch
    expected = tmp_path / "ckpt" / f"esi-epoch={epoch}-step={EXPECTED_SAVE_STEP}.ckpt"
    assert sorted((tmp_path / "ckpt").iterdir()) == [expected]
    assert callback.last_checkpoint_path == str(expected)
    assert callback.saves == 1 and callback.stopped is True
    assert trainer.should_stop is True
    assert trainer.global_step == EXPECTED_SAVE_STEP

    # Lightning checkpoints hold plain Python objects too (loops' state): weights_only=False.
    checkpoint = torch.load(expected, weights_only=False)
    assert checkpoint["global_step"] == EXPECTED_SAVE_STEP
    assert set(checkpoint["state_dict"]) == {"layer.weight", "layer.bias"}
    assert checkpoint["optimizer_states"]


def test_without_stop_trains_on_and_still_saves_once(
    tmp_path: Path, daemon_url: tuple[str, float]
) -> None:
    url, base_unix = daemon_url
    trainer, callback = train(tmp_path, url, base_unix, stop=False)
    assert len(list((tmp_path / "ckpt").iterdir())) == 1
    assert callback.saves == 1 and callback.stopped is False
    assert trainer.global_step == MAX_STEPS


def test_resume_from_our_checkpoint(tmp_path: Path, daemon_url: tuple[str, float]) -> None:
    url, base_unix = daemon_url
    _trainer, callback = train(tmp_path, url, base_unix)
    assert callback.last_checkpoint_path is not None

    model = TinyModule()
    resumed = make_trainer(tmp_path / "resumed", EXPECTED_SAVE_STEP + 3, [])
    resumed.fit(model, train_dataloaders=loader(), ckpt_path=callback.last_checkpoint_path)
    assert resumed.global_step == EXPECTED_SAVE_STEP + 3


def test_callback_class_is_built_lazily() -> None:
    import sidecar.integrations.lightning as module

    cls = module.EsiCheckpointCallback
    assert issubclass(cls, pl.Callback)
    assert cls is module.EsiCheckpointCallback
    default = cls()
    trainer = make_trainer(Path("/nonexistent-root"), 1, [])
    assert default.checkpoint_path(trainer) == (
        "/nonexistent-root/checkpoints/esi-epoch=0-step=0.ckpt"
    )


def test_two_processes_agree_with_the_default_guard(tmp_path: Path) -> None:
    """2 ranks (DDP, gloo), each with its own daemon; only rank 0's knows a near release.

    Both ranks save at the first step through Lightning's collective save_checkpoint
    and stop there; without agreement rank 1 would wait in the next step's all_reduce.
    """
    results = run_framework_ranks("lightning", tmp_path)
    for r in results:
        assert r["distributed"] is True and r["world_size"] == 2
        assert r["saves"] == 1 and r["stopped"] is True
        assert r["global_step"] == 1
    assert results[0]["path"] == results[1]["path"]
    assert results[0]["local_remaining"] < 200 < 10**5 < results[1]["local_remaining"]
    files = list((tmp_path / "ckpt").iterdir())
    assert [p.name for p in files] == ["esi-epoch=0-step=1.ckpt"]
    assert torch.load(files[0], weights_only=False)["global_step"] == 1
