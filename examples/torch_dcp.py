"""An FSDP2 loop saving sharded checkpoints with torch.distributed.checkpoint, in time.

    python examples/torch_dcp.py --nproc-per-node 2 --steps 100000 --release-in 10 \\
        --save-seconds 1 --redundant-seconds 4   # 2 gloo ranks: train, save, exit 75 (~25 s)
    python examples/torch_dcp.py --nproc-per-node 2 \\
        --output checkpoints/torch_dcp --steps N          # the "resume:" line it printed
    torchrun --nproc-per-node 2 examples/torch_dcp.py --steps 300   # the same ranks

Every rank holds a shard of the model and writes it: ``DistributedCheckpoint`` has rank 0
open one temporary folder for all of them and commit it (manifest last, then ``latest``)
once every rank's part is written, so a checkpoint is complete or absent, and resume picks
the newest valid one. ``--async`` (the default) saves with DCP's ``async_save``: the loop
waits only while the state is copied off the training tensors; the guard counts the
checkpoint as saved only once committed, and budgets the background write like an upload.
Keep OUTPUT on storage every rank sees. Each node asks its own daemon ($ESI_SIDECAR_URL,
default http://127.0.0.1:8791); ``--release-in`` fakes a near deadline through the
capacity-block variable instead (the daemon is then not asked). Ranks and exit status as
in torch_distributed.py (75 at the release). gloo on the CPU here; "cpu:gloo,cuda:nccl"
and the GPU for real runs."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Optional

import example_support as support
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

from sidecar.integrations.dcp import DistributedCheckpoint
from sidecar.integrations.distributed import distributed_guard


class TrainState(Stateful):
    """What a checkpoint holds: the sharded model and optimizer, and the step."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer, self.step = model, optimizer, 0

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.step = int(state["step"])


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
               rank: int) -> None:
    # The batch follows from (step, rank): a resumed run sees the batches it would have.
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    inputs = torch.randn(32, 8, generator=generator)
    loss = torch.nn.functional.mse_loss(model(inputs), inputs.sum(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def say(rank: int, text: str) -> None:
    # One write per line, so that the ranks' lines never interleave on a shared stdout.
    print(f"rank {rank}: {text}\n", end="", flush=True)


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    support.add_options(parser, "torch_dcp", steps=300, ranks=True)
    parser.add_argument("--async", dest="asynchronous", action=argparse.BooleanOptionalAction,
                        default=True, help="save with async_save (default) or save")
    return parser.parse_args(argv)


def rank_main(argv: list[str]) -> int:
    """One rank's run; its exit status."""
    args = parse(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("sidecar").setLevel(logging.INFO)  # "checkpoint now: ..." and why

    distributed = "RANK" in os.environ  # set by torchrun, or by --nproc-per-node
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    client, line = support.follow(args.release_in)  # after init: one deadline for all
    if rank == 0:
        print(line, flush=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    if distributed:  # each rank keeps a shard of every parameter
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = TrainState(model, optimizer)

    # After init_process_group: the guard and the checkpoint then agree across the ranks.
    guard = distributed_guard(policy=support.policy(args), client=client,
                              events=args.release_in is None)
    checkpoints = DistributedCheckpoint(args.output, guard=guard, keep_last=2)
    found = checkpoints.load({"train": state})  # collective: rank 0 picks, all load it
    if found is not None:
        say(rank, f"start: resuming from step {state.step} ({found.path})")
    else:
        say(rank, "start: from scratch")

    while state.step < args.steps:
        with guard.step():
            train_step(model, optimizer, state.step, rank)
        state.step += 1
        if guard.should_save():  # collective: every rank calls it, every rank agrees
            if args.asynchronous:
                checkpoints.async_save({"train": state}, state.step)
            else:
                checkpoints.save({"train": state}, state.step)
            say(rank, f"saved: checkpoint at step {state.step}")
        # Waits for the release after the final save; the background write goes on.
        if guard.should_stop():
            say(rank, f"stop: step {state.step}")
            break
    committed = checkpoints.wait()  # the last asynchronous save, committed on every rank
    if committed is not None:
        say(rank, f"committed: step {committed.step} ({committed.path.name})")
    say(rank, f"done: trained {state.step}/{args.steps} steps")
    if distributed:
        dist.barrier()  # leave together: a peer tearing down gloo early can abort the others
        dist.destroy_process_group()
    if rank == 0 and not support.launched():
        support.finished(args, stopped=state.step < args.steps, torchrun=distributed)
    return support.exit_status(guard.released)


if __name__ == "__main__":
    raise SystemExit(support.ranks_main(parse, rank_main))
