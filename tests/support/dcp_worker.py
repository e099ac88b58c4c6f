"""One rank of the torch.distributed.checkpoint test (run by test_integration_dcp).

    python dcp_worker.py '<json config>'

A real gloo process group, a small FSDP2-sharded model (every rank holds a shard and writes
it), real DCP ``save`` and ``async_save`` through ``DistributedCheckpoint``, and a real
``CheckpointGuard`` whose deadline comes from the capacity-block variable (no daemon: the
URL refuses connections). ``config["scenario"]`` picks what runs; the rank writes a JSON
result to ``config["result"]`` with what it saw.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

from sidecar.checkpoint.folders import CheckpointError, latest_valid
from sidecar.integrations.dcp import DistributedCheckpoint
from sidecar.integrations.distributed import distributed_guard
from sidecar.train.client import SidecarClient
from sidecar.train.policy import SavePolicy

VARIABLE = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"


class TrainState(Stateful):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 fail: bool = False) -> None:
        self.model, self.optimizer, self.step, self.fail = model, optimizer, 0, fail

    def state_dict(self) -> dict[str, Any]:
        if self.fail:
            raise RuntimeError("state_dict() failed on purpose")
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.step = int(state["step"])


class GatedWriter(FileSystemWriter):
    """The real FileSystemWriter, whose final step (rank 0 writes .metadata) waits for a
    file to appear; or whose write fails on one rank."""

    def __init__(self, path: Path, gate: Path | None, fail: bool) -> None:
        super().__init__(path)
        self.gate, self.fail = gate, fail

    def write_data(self, plan: Any, planner: Any) -> Any:
        if self.fail:
            raise OSError(28, "No space left on device (on purpose)")
        return super().write_data(plan, planner)

    def finish(self, metadata: Any, results: Any) -> None:
        limit = time.monotonic() + 60
        while self.gate is not None and not self.gate.exists() and time.monotonic() < limit:
            time.sleep(0.02)
        super().finish(metadata, results)


def make_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(step * 1000 + dist.get_rank())
    inputs = torch.randn(16, 8, generator=generator)
    loss = torch.nn.functional.mse_loss(model(inputs), inputs.sum(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def full(model: torch.nn.Module) -> list[list[float]]:
    return [p.full_tensor().flatten().tolist() for p in model.parameters()]


def temporary_names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".")) if root.exists() else []


def scenario_commit(config: dict[str, Any], result: dict[str, Any]) -> None:
    """A blocking save, then an async one held before its commit, then a resume."""
    root = Path(config["root"])
    rank = dist.get_rank()
    gate = Path(config["gate"])
    model, optimizer = make_model(0)
    state = TrainState(model, optimizer)
    for step in range(1, 3):
        train(model, optimizer, step)
        state.step = step
    ckpt = DistributedCheckpoint(root, writer=lambda path: GatedWriter(path, gate, False))
    gate.touch()  # the blocking save goes straight through
    info = ckpt.save({"train": state}, 2)
    result["blocking"] = {"name": info.name, "files": sorted(f.path for f in info.files)}
    result["saved_weights"] = full(model)
    if rank == 0:
        gate.unlink()
    dist.barrier()
    train(model, optimizer, 3)
    state.step = 4
    pending = ckpt.async_save({"train": state}, 4)
    train(model, optimizer, 4)  # training goes on while the write is held at its end
    dist.barrier()
    newest = latest_valid(root, clean=False)
    result["during"] = {"latest": None if newest is None else newest.step,
                        "committed": pending.committed(), "done": pending.done()}
    dist.barrier()
    if rank == 0:
        gate.touch()
    committed = ckpt.wait(timeout=60)
    assert committed is not None
    result["after"] = {"latest": committed.step, "committed": pending.committed(),
                       "temporary": temporary_names(root)}
    # Resume: a fresh model (other weights) loads the blocking save's state.
    model2, optimizer2 = make_model(1)
    state2 = TrainState(model2, optimizer2)
    loaded = DistributedCheckpoint(root).load({"train": state2})
    result["loaded"] = {"step": state2.step, "name": None if loaded is None else loaded.name}
    result["loaded_weights"] = full(model2)


def scenario_fault(config: dict[str, Any], result: dict[str, Any]) -> None:
    """A good checkpoint, then saves that fail on rank 1 only, in three ways."""
    root = Path(config["root"])
    rank = dist.get_rank()
    model, optimizer = make_model(0)
    train(model, optimizer, 1)
    fail_write = {"value": False}
    ckpt = DistributedCheckpoint(
        root, writer=lambda path: GatedWriter(path, None, fail_write["value"] and rank == 1))
    ckpt.save({"train": TrainState(model, optimizer)}, 1)
    outcomes: dict[str, str] = {}
    try:  # rank 1's state_dict() raises before DCP starts
        ckpt.save({"train": TrainState(model, optimizer, fail=rank == 1)}, 2)
        outcomes["state"] = "saved"
    except CheckpointError as exc:
        outcomes["state"] = str(exc)
    fail_write["value"] = True
    try:  # rank 1's write fails inside DCP (blocking)
        ckpt.save({"train": TrainState(model, optimizer)}, 3)
        outcomes["write"] = "saved"
    except CheckpointError as exc:
        outcomes["write"] = str(exc)
    pending = ckpt.async_save({"train": TrainState(model, optimizer)}, 4)
    try:  # ... and in the background
        ckpt.wait(timeout=60)
        outcomes["async"] = "saved"
    except CheckpointError as exc:
        outcomes["async"] = str(exc)
    result["async_committed"] = pending.committed()
    fail_write["value"] = False
    ckpt.save({"train": TrainState(model, optimizer)}, 5)  # and then it works again
    dist.barrier()
    newest = latest_valid(root, clean=False)
    result["outcomes"] = outcomes
    result["latest"] = None if newest is None else newest.step
    result["folders"] = sorted(p.name for p in root.iterdir())


def scenario_unshared(config: dict[str, Any], result: dict[str, Any]) -> None:
    """Each rank its own folder, as on nodes with local disks only."""
    rank = dist.get_rank()
    root = Path(config["root"]) / f"node{rank}"
    model, optimizer = make_model(0)
    try:
        DistributedCheckpoint(root).save({"train": TrainState(model, optimizer)}, 1)
        result["outcome"] = "saved"
    except CheckpointError as exc:
        result["outcome"] = str(exc)
    result["folders"] = sorted(p.name for p in root.iterdir()) if root.exists() else []


def scenario_guard(config: dict[str, Any], result: dict[str, Any]) -> None:
    """The guard decides; the final save is asynchronous and counts once committed."""
    root = Path(config["root"])
    rank = dist.get_rank()
    gate = Path(config["gate"])
    # From now (ranks start at different times); the ranks agree on the earliest.
    deadline = time.time() + float(config["deadline_in"])
    result["deadline_unix"] = deadline
    guard = distributed_guard(
        client=SidecarClient("http://127.0.0.1:9", timeout=0.2),
        policy=SavePolicy(save_seconds=1.0, redundant_seconds=float(config["redundant"]),
                          top_up_seconds=None),
        environ={VARIABLE: str(deadline)},
        wait_for_release=False,
    )
    model, optimizer = make_model(0)
    state = TrainState(model, optimizer)
    ckpt = DistributedCheckpoint(root, guard=guard,
                                 writer=lambda path: GatedWriter(path, gate, False))
    saved_at: list[int] = []
    pending = None
    limit = time.monotonic() + 60
    while time.monotonic() < limit:
        with guard.step():
            train(model, optimizer, state.step)
            time.sleep(0.05)
        state.step += 1
        if guard.should_save():
            pending = ckpt.async_save({"train": state}, state.step)
            saved_at.append(state.step)
        if guard.should_stop():
            break
    assert pending is not None
    status = guard.status()
    result["saved_at"] = saved_at
    result["stopped_at"] = state.step
    result["before_commit"] = {"final_step": status.final_step,
                               "durable": status.final_durable_at_unix,
                               "committed": pending.committed()}
    dist.barrier()
    if rank == 0:
        gate.touch()
    ckpt.wait(timeout=60)
    status = guard.status()
    limit = time.monotonic() + 10  # the guard looks again at most once per refresh (1 s)
    while status.final_durable_at_unix is None and time.monotonic() < limit:
        time.sleep(0.1)
        status = guard.status()
    result["after_commit"] = {"final_step": status.final_step,
                              "durable": status.final_durable_at_unix,
                              "committed": pending.committed(),
                              "async_write": guard.async_write_estimate()}


def scenario_stream(config: dict[str, Any], result: dict[str, Any]) -> None:
    """One async save held before its commit until the test creates ``config["release"]``
    (the test watches the uploader send the shards meanwhile), then committed."""
    root = Path(config["root"])
    release = Path(config["release"])
    model, optimizer = make_model(0)
    state = TrainState(model, optimizer)
    train(model, optimizer, 1)
    state.step = 1
    ckpt = DistributedCheckpoint(root, checksum=True,
                                 writer=lambda path: GatedWriter(path, release, False))
    ckpt.async_save({"train": state}, 1)
    committed = ckpt.wait(timeout=90)
    assert committed is not None
    result["committed"] = {"name": committed.name,
                           "files": sorted(f.path for f in committed.files)}


def scenario_drill(config: dict[str, Any], result: dict[str, Any]) -> None:
    """A fire drill from the real daemon: every rank saves for it through DCP (async, it
    counts once committed), none stops, and training goes on past the verdict."""
    from drill_support import DrillScript

    root = Path(config["root"])
    rank = dist.get_rank()
    guard = distributed_guard(
        client=SidecarClient(config["url"]), environ={}, refresh_seconds=0.05,
        policy=SavePolicy(save_seconds=1.0, redundant_seconds=1.0, top_up_seconds=None))
    script = DrillScript(config["url"], lead=float(config["lead"]))
    model, optimizer = make_model(0)
    state = TrainState(model, optimizer)
    ckpt = DistributedCheckpoint(root, guard=guard)
    saved_at: list[int] = []
    stopped = False
    while True:
        with guard.step():
            train(model, optimizer, state.step)
            time.sleep(0.05)
        state.step += 1
        if guard.should_save():
            ckpt.async_save({"train": state}, state.step)
            saved_at.append(state.step)
        stopped = stopped or guard.should_stop()
        # Rank 0 runs the drill and says when the test ends; every rank leaves together.
        done = torch.tensor([1 if rank == 0 and script.at_step(state.step) else 0])
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
        if done.item():
            break
    ckpt.wait(timeout=60)
    result.update(saved_at=saved_at, last_step=state.step, stopped=stopped,
                  verdicts=script.verdicts)


SCENARIOS = {"commit": scenario_commit, "fault": scenario_fault,
             "unshared": scenario_unshared, "guard": scenario_guard,
             "stream": scenario_stream, "drill": scenario_drill}


def main() -> None:
    config = json.loads(sys.argv[1])
    dist.init_process_group("gloo", init_method=config["init_method"], rank=config["rank"],
                            world_size=config["world_size"], timeout=timedelta(seconds=30))
    result: dict[str, Any] = {"rank": config["rank"]}
    try:
        SCENARIOS[config["scenario"]](config, result)
    finally:
        Path(config["result"]).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    # As the other workers do: skip interpreter finalisation, where gloo sometimes aborts
    # after a clean teardown (docs/integrations.md, "Exit with gloo").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
