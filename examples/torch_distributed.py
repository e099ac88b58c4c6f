"""A torch.distributed (DDP) loop where every rank saves at the same step, in time.

    python examples/torch_distributed.py --nproc-per-node 2 --steps 100000 --release-in 10 \\
        --save-seconds 1 --redundant-seconds 4   # 2 gloo ranks: train, save, exit 75 (~30 s)
    python examples/torch_distributed.py --nproc-per-node 2 \\
        --output checkpoints/torch_distributed --steps N    # the "resume:" line it printed
    torchrun --nproc-per-node 2 examples/torch_distributed.py --steps 300   # the same ranks

``distributed_guard()`` reduces every decision across the ranks (one small all_reduce),
so all ranks agree on the step to save at and on when to stop: a rank deciding alone
would hang the others in the next collective. DDP keeps the replicas identical, so rank 0
writes the checkpoint with ``atomic_checkpoint`` (complete or absent, never torn) and
every rank resumes from the one ``latest_valid`` finds (keep OUTPUT on storage every rank
sees). Each node asks its own daemon ($ESI_SIDECAR_URL, default http://127.0.0.1:8791);
``--release-in`` fakes a near deadline through the capacity-block variable instead (the
daemon is then not asked). Every rank exits with ``EXIT_RELEASED`` (75) at the release;
``--nproc-per-node`` starts the ranks itself and exits 75 too, where torchrun reports a
rank's 75 as a failed run (exit 1, "exitcode: 75" in its summary).
gloo on the CPU here; use "nccl" and move the model to the GPU for real runs."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Optional

import example_support as support
import torch
import torch.distributed as dist

from sidecar.checkpoint.folders import atomic_checkpoint, latest_valid
from sidecar.integrations.distributed import distributed_guard


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
               rank: int) -> None:
    # The batch follows from (step, rank): a resumed run sees the batches it would have.
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    inputs = torch.randn(32, 8, generator=generator)
    loss = torch.nn.functional.mse_loss(model(inputs), inputs.sum(dim=1, keepdim=True))
    optimizer.zero_grad()
    loss.backward()  # DDP averages the gradients across ranks here
    optimizer.step()


def say(rank: int, text: str) -> None:
    # One write per line, so that the ranks' lines never interleave on a shared stdout.
    print(f"rank {rank}: {text}\n", end="", flush=True)


def parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    support.add_options(parser, "torch_distributed", steps=300, ranks=True)
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
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    # Rank 0 looks (and cleans up after killed saves), every rank loads what it found.
    found = [latest_valid(args.output) if rank == 0 else None]
    if distributed:
        dist.broadcast_object_list(found, src=0)
    start_step = 0
    if found[0] is not None:
        state = torch.load(found[0].path / "state.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_step = state["step"]
        say(rank, f"start: resuming from step {start_step} ({found[0].path})")
    else:
        say(rank, "start: from scratch")
    ddp = torch.nn.parallel.DistributedDataParallel(model) if distributed else model

    # After init_process_group: the guard then reduces its decisions across the ranks.
    guard = distributed_guard(policy=support.policy(args), client=client,
                              events=args.release_in is None)
    step = start_step  # steps done, as in the checkpoint's name
    while step < args.steps:
        with guard.step():
            train_step(ddp, optimizer, step, rank)
        step += 1
        if guard.should_save():  # collective: every rank calls it, every rank agrees
            with guard.saving(step):  # timed; the slowest rank's time wins
                if rank == 0:
                    with atomic_checkpoint(args.output, step, keep_last=2) as folder:
                        torch.save({"model": model.state_dict(),
                                    "optimizer": optimizer.state_dict(),
                                    "step": step}, folder / "state.pt")
            say(rank, f"saved: checkpoint at step {step}")
        # Collective too; the other ranks wait in it until rank 0's save is committed.
        if guard.should_stop():
            say(rank, f"stop: step {step}")  # the guard logged why
            break
    say(rank, f"done: trained {step}/{args.steps} steps")
    if distributed:
        dist.barrier()  # leave together: a peer tearing down gloo early can abort the others
        dist.destroy_process_group()
    if rank == 0 and not support.launched():
        support.finished(args, stopped=step < args.steps, torchrun=distributed)
    return support.exit_status(guard.released)


if __name__ == "__main__":
    raise SystemExit(support.ranks_main(parse, rank_main))
