"""One rank of a 2-process HF Trainer or Lightning run on CPU (gloo), for the tests.

    RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. MASTER_ADDR=.. MASTER_PORT=.. ESI_SIDECAR_URL=..
    python framework_ddp_worker.py hf|lightning <output dir> <result.json>

Started like torchrun starts ranks (environment variables), so each framework sets up
torch.distributed itself. The callback is used with its DEFAULT guard (policy defaults,
real clocks, the daemon from ESI_SIDECAR_URL, which differs per rank): this is what a
user gets, and the reducer must be picked up on its own. Only the top-up save is off:
with the release 100 real seconds ahead it would train on until 5 s before it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sidecar.integrations.distributed import TorchReducer, reducer_if_distributed
from sidecar.train.policy import SavePolicy

MAX_STEPS = 10


def run_hf(out: Path) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from sidecar.integrations.transformers import EsiCheckpointCallback

    class TinyDataset(torch.utils.data.Dataset[dict[str, Any]]):
        def __init__(self) -> None:
            generator = torch.Generator().manual_seed(0)
            self.rows = torch.randint(0, 64, (32, 8), generator=generator)

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, index: int) -> dict[str, Any]:
            return {"input_ids": self.rows[index], "labels": self.rows[index]}

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    )
    args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        max_steps=MAX_STEPS,
        per_device_train_batch_size=2,
    )
    # The stop decision, agreed by both ranks, answered at once: waiting for rank 0's
    # release (100 s ahead) is what test_release_wait.py checks.
    callback = EsiCheckpointCallback(policy=SavePolicy(top_up_seconds=None),
                                     wait_for_release=False)
    trainer = Trainer(model=model, args=args, train_dataset=TinyDataset(), callbacks=[callback])
    trainer.train()
    return {
        "global_step": trainer.state.global_step,
        "saves": callback.saves_requested,
        "saves_recorded": callback.saves_recorded,
        "stopped": callback.stopped,
        "local_remaining": callback.guard.status().remaining_seconds,
    }


def run_lightning(out: Path) -> dict[str, Any]:
    import lightning.pytorch as pl
    from tiny_lightning import TinyModule

    from sidecar.integrations.lightning import EsiCheckpointCallback

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 4, generator=generator)
    dataset = torch.utils.data.TensorDataset(inputs, inputs.sum(dim=1, keepdim=True))
    callback = EsiCheckpointCallback(out / "ckpt", policy=SavePolicy(top_up_seconds=None),
                                     wait_for_release=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=MAX_STEPS,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=str(out),
        callbacks=[callback],
    )
    trainer.fit(TinyModule(), train_dataloaders=torch.utils.data.DataLoader(dataset, batch_size=4))
    return {
        "global_step": trainer.global_step,
        "saves": callback.saves,
        "stopped": callback.stopped,
        "path": callback.last_checkpoint_path,
        "local_remaining": callback.guard.status().remaining_seconds,
    }


def main() -> None:
    mode, out, result_path = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    result = run_hf(out) if mode == "hf" else run_lightning(out)
    result["rank"] = int(os.environ["RANK"])
    result["distributed"] = isinstance(reducer_if_distributed(), TorchReducer)
    result["world_size"] = dist.get_world_size() if dist.is_initialized() else 1
    with open(result_path, "w") as handle:
        json.dump(result, handle)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # As in distributed_worker.py: skip finalization, where torch's gloo threads may
    # abort the process after a clean shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
