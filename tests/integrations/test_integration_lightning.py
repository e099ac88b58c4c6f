"""A real lightning.Trainer (CPU, tiny LightningModule) with EsiCheckpointCallback.

Same numbers as the Hugging Face test: release 950 simulated seconds ahead, the guard's
clock advancing 100 s per optimizer step, save 30 s + redundant 40 s: the save happens
at global step 9, and training stops there. With gradient accumulation the decision is
taken per optimizer step, not per batch, so the answer is the same step.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import sys
import textwrap
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

import pytest
from daemon_harness import serve_daemon, wait_for
from drill_support import DrillScript
from rank_launcher import base_environment, free_port, run_framework_ranks, run_ranks

import sidecar.integrations.distributed as distributed
from sidecar.train.client import SidecarClient
from sidecar.train.guard import CheckpointGuard
from sidecar.train.policy import SavePolicy

pytest.importorskip("torch")
pytest.importorskip("lightning")

import lightning.pytorch as pl
import torch
from tiny_lightning import TinyModule

from sidecar.integrations.lightning import checkpoint_step, latest_checkpoint

pytestmark = pytest.mark.frameworks

RELEASE_AFTER = 950
WALL_SECONDS_PER_STEP = 100
EXPECTED_SAVE_STEP = 9
MAX_STEPS = 20


def loader() -> Any:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 4, generator=generator)
    dataset = torch.utils.data.TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    return torch.utils.data.DataLoader(dataset, batch_size=4)


def make_trainer(
    root: Path, max_steps: int, callbacks: list[Any], accumulate: int = 1,
    plugins: Optional[list[Any]] = None,
) -> Any:
    return pl.Trainer(
        plugins=plugins,
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
    tmp_path: Path,
    url: str,
    base_unix: float,
    *,
    accumulate: int = 1,
    stop: bool = True,
    by_policy: bool = False,
    plugins: Optional[list[Any]] = None,
    top_up: Optional[float] = None,
    straggler: Optional[int] = None,
) -> tuple[Any, Any]:
    """One fit; ``by_policy``: the callback gets policy= and guard options, not guard=.

    ``top_up``: the top-up margin (None: none, the save-once-and-stop tests). With one,
    steps and saves are timed on the simulated clock too (a step takes its 100 s), so
    that whether a top-up fits is decided on the same time the release uses. ``straggler``:
    that optimizer step takes 120 s more."""
    from sidecar.integrations.lightning import EsiCheckpointCallback

    holder: dict[str, Any] = {}

    def clock() -> float:  # simulated wall time: 100 s per completed optimizer step
        trainer = holder.get("trainer")
        step = 0 if trainer is None else trainer.global_step
        late = 120 if straggler is not None and step >= straggler else 0
        return base_unix + WALL_SECONDS_PER_STEP * step + late

    policy = SavePolicy(save_seconds=30, redundant_seconds=40, top_up_seconds=top_up)
    timing: dict[str, Any] = {} if top_up is None else {"monotonic": clock}
    if by_policy:
        callback = EsiCheckpointCallback(
            tmp_path / "ckpt", stop_after_save=stop,
            policy=policy, client=SidecarClient(url), clock=clock,
            wait_for_release=False,  # the simulated clock moves only with steps
        )
        assert callback.guard is None  # built in on_train_start, inside fit()
    else:
        guard = CheckpointGuard(client=SidecarClient(url), policy=policy, clock=clock,
                                wait_for_release=False, **timing)
        callback = EsiCheckpointCallback(tmp_path / "ckpt", guard=guard, stop_after_save=stop,
                                         **timing)
    trainer = make_trainer(tmp_path, MAX_STEPS, [callback], accumulate=accumulate,
                           plugins=plugins)
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
    assert latest_checkpoint(tmp_path / "ckpt") == expected

    # Lightning checkpoints hold plain Python objects too (loops' state): weights_only=False.
    checkpoint = torch.load(expected, weights_only=False)
    assert checkpoint["global_step"] == EXPECTED_SAVE_STEP
    assert set(checkpoint["state_dict"]) == {"layer.weight", "layer.bias"}
    assert checkpoint["optimizer_states"]


def test_top_up_save_after_the_final_one_then_stops(
    tmp_path: Path, daemon_url: tuple[str, float]
) -> None:
    # Steps take 100 s: the final save at step 8 (150 s left <= 100 + 30 + 40). The save
    # takes no simulated time, so 150 s > a step + the save + a 0 s margin: train step
    # 9 and save again there (50 s left), then stop.
    url, base_unix = daemon_url
    trainer, callback = train(tmp_path, url, base_unix, top_up=0.0)
    names = sorted(path.name for path in (tmp_path / "ckpt").iterdir())
    assert names == ["esi-epoch=0-step=8.ckpt", "esi-epoch=0-step=9.ckpt"]
    assert callback.saves == 2 and callback.stopped is True
    assert trainer.global_step == 9
    status = callback.guard.status()
    assert (status.final_step, status.top_up_step) == (8, 9)


def test_a_top_up_that_no_longer_fits_stops_without_a_save(
    tmp_path: Path, daemon_url: tuple[str, float]
) -> None:
    # As above, but step 9 straggles (220 s): the release has passed when it ends, so no
    # top-up save is started and training stops there (not at max_steps: the callback
    # stops on the guard's decision at a step without a save too).
    url, base_unix = daemon_url
    trainer, callback = train(tmp_path, url, base_unix, top_up=0.0, straggler=9)
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["esi-epoch=0-step=8.ckpt"]
    assert callback.saves == 1 and callback.stopped is True
    assert trainer.global_step == 9


def test_no_top_up_when_no_step_fits_after_the_final_save(
    tmp_path: Path, daemon_url: tuple[str, float]
) -> None:
    # A 60 s margin: 150 s left after the final save at step 8 <= 100 + 0 + 60: stop there.
    url, base_unix = daemon_url
    trainer, callback = train(tmp_path, url, base_unix, top_up=60.0)
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["esi-epoch=0-step=8.ckpt"]
    assert callback.saves == 1 and callback.stopped is True
    assert trainer.global_step == 8


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

    # The guard's measurements travel in the checkpoint's callback state...
    saved = torch.load(callback.last_checkpoint_path, weights_only=False)["callbacks"]
    (state,) = [v for v in saved.values() if isinstance(v, dict) and "guard" in v]
    learned = state["guard"]["policy"]
    assert len(learned["steps"]) == EXPECTED_SAVE_STEP

    # ...and seed the guard of the resumed run before its first decision.
    from sidecar.integrations.lightning import EsiCheckpointCallback

    seen: list[int] = []
    fresh = EsiCheckpointCallback(tmp_path / "resumed-ckpt", client=SidecarClient(url),
                                  wait_for_release=False)
    model = TinyModule()
    resumed = make_trainer(tmp_path / "resumed", EXPECTED_SAVE_STEP + 3, [fresh])
    original = fresh.on_train_start

    def spy(trainer: Any, pl_module: Any) -> None:
        original(trainer, pl_module)
        seen.append(len(fresh.guard.policy.state_dict()["steps"]))

    fresh.on_train_start = spy  # type: ignore[method-assign]
    resumed.fit(model, train_dataloaders=loader(), ckpt_path=callback.last_checkpoint_path)
    assert resumed.global_step == EXPECTED_SAVE_STEP + 3
    assert seen == [EXPECTED_SAVE_STEP]


def test_the_callback_is_an_ordinary_class_of_the_module() -> None:
    """Defined at the module's top (what IDEs and mypy read), not built by a ``__getattr__``."""
    import sidecar.integrations.lightning as module

    cls = module.EsiCheckpointCallback
    assert inspect.isclass(cls) and vars(module)["EsiCheckpointCallback"] is cls
    assert not hasattr(module, "__getattr__")
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


def test_policy_builds_the_guard_at_train_start(
    tmp_path: Path, daemon_url: tuple[str, float]
) -> None:
    """policy= and guard options (client, clock) instead of guard=: the same save."""
    url, base_unix = daemon_url
    trainer, callback = train(tmp_path, url, base_unix, by_policy=True)
    assert callback.guard.policy.save_seconds == 30
    assert callback.guard.policy.redundant_seconds == 40
    assert callback.guard.client.urls == SidecarClient(url).urls
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == [
        f"esi-epoch=0-step={EXPECTED_SAVE_STEP}.ckpt"
    ]
    assert callback.saves == 1 and callback.stopped is True
    assert trainer.global_step == EXPECTED_SAVE_STEP


def test_guard_with_policy_or_options_is_refused() -> None:
    from sidecar.integrations.lightning import EsiCheckpointCallback

    guard = CheckpointGuard(client=SidecarClient("http://127.0.0.1:9"))
    with pytest.raises(ValueError, match="either guard= or policy="):
        EsiCheckpointCallback("ckpt", guard=guard, policy=SavePolicy())
    with pytest.raises(ValueError, match="refresh_seconds"):
        EsiCheckpointCallback("ckpt", guard=guard, refresh_seconds=5)
    with pytest.raises(TypeError, match="'refresh_second'"):
        EsiCheckpointCallback("ckpt", refresh_second=5)  # a typo fails here, not in fit()
    callback = EsiCheckpointCallback("ckpt", policy=SavePolicy(), refresh_seconds=5)
    assert callback.guard is None and callback.policy is not None


def test_guard_without_reducer_is_warned_about_when_distributed(
    tmp_path: Path, daemon_url: tuple[str, float], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A guard= built before fit() has no reducer: said once training starts."""
    url, base_unix = daemon_url
    monkeypatch.setattr(distributed, "_world_size", lambda: 2)  # as seen inside fit() on 2 ranks
    with caplog.at_level(logging.WARNING, logger="sidecar.integrations.distributed"):
        train(tmp_path, url, base_unix)
    assert any("has no reducer" in r.getMessage() and "2 ranks" in r.getMessage()
               for r in caplog.records)


def test_a_save_cut_short_keeps_a_temporary_name(
    tmp_path: Path, daemon_url: tuple[str, float]
) -> None:
    """The write fails half-way (a kill, a full disk): the checkpoint's name never appears.

    The CheckpointIO below writes part of the file to the path it is given, then fails,
    as a non-atomic writer does. latest_checkpoint() still answers the older, complete one.
    """
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    class FailingHalfway(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint: Any, path: Any, storage_options: Any = None) -> None:
            Path(path).write_bytes(b"PK\x03\x04 half a checkpoint")
            raise OSError("No space left on device")

    folder = tmp_path / "ckpt"
    folder.mkdir()
    older = folder / "esi-epoch=0-step=3.ckpt"
    older.write_bytes(b"an earlier complete save")
    url, base_unix = daemon_url
    with pytest.raises(OSError, match="No space left"):
        train(tmp_path, url, base_unix, plugins=[FailingHalfway()])
    partial = f"esi-epoch=0-step={EXPECTED_SAVE_STEP}.ckpt.tmp-{os.getpid()}"
    assert sorted(p.name for p in folder.iterdir()) == [older.name, partial]
    assert latest_checkpoint(folder) == older


def test_latest_checkpoint_by_step_complete_names_only(tmp_path: Path) -> None:
    for name in (
        "esi-epoch=0-step=9.ckpt",
        "esi-epoch=1-step=20.ckpt",
        "esi-epoch=2-step=31.ckpt.tmp-4242",  # a save cut short
        "esi-epoch=9-step=7.ckpt",  # a higher epoch, an older step
        "last.ckpt",
        "esi-epoch=3-step=40.ckpt.bak",
    ):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "esi-epoch=1-step=25.ckpt").mkdir()  # sharded strategies save folders
    assert latest_checkpoint(tmp_path) == tmp_path / "esi-epoch=1-step=25.ckpt"
    assert latest_checkpoint(str(tmp_path / "missing")) is None
    assert checkpoint_step(tmp_path / "esi-epoch=1-step=20.ckpt") == 20
    assert checkpoint_step("esi-epoch=2-step=31.ckpt.tmp-4242") is None

    custom = "run-{step:06d}.ckpt"
    for name in ("run-000100.ckpt", "run-000099.ckpt", "run-000101.ckpt.tmp-1"):
        (tmp_path / name).write_bytes(b"x")
    assert latest_checkpoint(tmp_path, custom) == tmp_path / "run-000100.ckpt"
    assert checkpoint_step("run-000100.ckpt", custom) == 100
    with pytest.raises(ValueError, match="no \\{step\\}"):
        latest_checkpoint(tmp_path, "esi-{epoch}.ckpt")
    with pytest.raises(ValueError, match="unknown field"):
        latest_checkpoint(tmp_path, "esi-{step}-{loss}.ckpt")


POLICY_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from sidecar.integrations.distributed import TorchReducer
    from sidecar.integrations.lightning import EsiCheckpointCallback
    from sidecar.train.policy import SavePolicy

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
        def training_step(self, batch, batch_idx):
            inputs, targets = batch
            return torch.nn.functional.mse_loss(self.layer(inputs), targets)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    out, result = sys.argv[1], sys.argv[2]
    # Built BEFORE fit(), before the process group exists: the user's usual order.
    callback = EsiCheckpointCallback(
        os.path.join(out, "ckpt"),
        policy=SavePolicy(save_seconds=60, redundant_seconds=500, top_up_seconds=None),
        wait_for_release=False,
    )
    assert not dist.is_initialized() and callback.guard is None
    inputs = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=10,
        enable_progress_bar=False, enable_model_summary=False, logger=False,
        enable_checkpointing=False, default_root_dir=out, callbacks=[callback],
    )
    trainer.fit(Tiny(), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=4))
    with open(result, "w") as handle:
        json.dump({
            "saves": callback.saves, "stopped": callback.stopped,
            "global_step": trainer.global_step, "path": callback.last_checkpoint_path,
            "reducer": isinstance(callback.guard._vote.reducer, TorchReducer),
            "redundant": callback.guard.policy.redundant_seconds,
        }, handle)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)  # see tests/support/distributed_worker.py: gloo may abort at interpreter exit
    """
)


def test_two_processes_agree_with_a_policy_given_before_fit(tmp_path: Path) -> None:
    """The callback is built before fit() (no process group yet) with policy=.

    Rank 0's daemon knows a release 300 s ahead: inside this policy's budget (60 + 500 s
    + a step) but not the default's (180 s). Rank 1's knows one 10^6 s ahead. Both save
    at the first step: rank 0 by the policy passed, rank 1 through the reducer that the
    guard built in on_train_start found.
    """
    worker = tmp_path / "policy_worker.py"
    worker.write_text(POLICY_WORKER)
    now = int(time.time())
    port = free_port()
    with ExitStack() as stack:
        environments, commands = [], []
        for rank, release_after in enumerate((300, 10**6)):
            daemon = stack.enter_context(
                serve_daemon(sources=("static",), expires_at=str(now + release_after))
            )
            wait_for(lambda d=daemon: d.store.health().ok)
            env = base_environment()
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                       LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       ESI_SIDECAR_URL=daemon.url)
            environments.append(env)
            commands.append([sys.executable, str(worker), str(tmp_path),
                             str(tmp_path / f"result-{rank}.json")])
        outcomes = run_ranks(commands, environments, tmp_path, limit=100)
    for code, stderr in outcomes:
        assert code == 0, stderr[-3000:]
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in (0, 1)]
    for r in results:
        assert r["reducer"] is True and r["redundant"] == 500
        assert r["saves"] == 1 and r["stopped"] is True and r["global_step"] == 1
    assert results[0]["path"] == results[1]["path"]
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["esi-epoch=0-step=1.ckpt"]


def test_a_fire_drill_saves_through_lightnings_save_and_training_goes_on(
    tmp_path: Path,
) -> None:
    """A drill served by the real daemon: the callback saves through
    ``trainer.save_checkpoint``, the daemon records PASS, and fit() trains on (no stop)."""
    from sidecar.integrations.lightning import EsiCheckpointCallback

    with serve_daemon(sources=("static",), expires_at=repr(time.time() + 3600)) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        script = DrillScript(daemon.url, lead=4.0)

        class Pace(pl.Callback):
            """Steps of 50 ms (the model's take microseconds); the drill's script."""

            def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
                time.sleep(0.05)  # the training step itself

            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                if script.at_step(trainer.global_step):
                    trainer.should_stop = True  # the test's end, not the guard's

        callback = EsiCheckpointCallback(
            tmp_path / "ckpt",
            policy=SavePolicy(save_seconds=0.5, redundant_seconds=1.0, top_up_seconds=None),
            client=SidecarClient(daemon.url), refresh_seconds=0.05, environ={})
        trainer = make_trainer(tmp_path, 2000, [callback, Pace()])
        torch.manual_seed(0)
        trainer.fit(TinyModule(), train_dataloaders=loader())
    assert script.passed(), script.verdicts
    step = script.verdicts[0]["figures"]["step"]
    assert callback.saves == 1 and callback.stopped is False
    saved = latest_checkpoint(tmp_path / "ckpt")
    assert saved is not None and checkpoint_step(saved) == step
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == [saved.name]  # no partial
    assert trainer.global_step == script.end_step > step  # trained on past the drill
