"""A Hugging Face Trainer that saves before the machine is released, then stops.

    python examples/hf_trainer.py --steps 100000 --release-in 10 \\
        --save-seconds 1 --redundant-seconds 4     # trains a few s, saves, exits 75 (~25 s)
    python examples/hf_trainer.py --output checkpoints/hf_trainer --steps N
                                 # the "resume:" line it printed: resumes, 50 steps, done

The callback asks the daemon ($ESI_SIDECAR_URL, default http://127.0.0.1:8791) at every
optimizer step; without a daemon it falls back to the platform's capacity-block variable,
which ``--release-in`` sets for this process only (the daemon is then not asked: that
deadline wins; the first line printed says which one is followed). When the deadline is
near, the Trainer writes its usual ``checkpoint-<step>`` folder once and training stops;
the next start resumes from it with ``resume_from_checkpoint``. The model is a one-layer
GPT-2 built from a config (nothing is downloaded), the data random tokens, the device the
CPU.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any, Optional

import torch
from example_support import add_options, exit_status, follow, policy, resume_line
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from sidecar.integrations.transformers import EsiCheckpointCallback, latest_complete_checkpoint


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random token rows; stands in for your tokenised dataset."""

    def __init__(self, rows: int = 64, length: int = 16) -> None:
        generator = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, 64, (rows, length), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_options(parser, "hf_trainer", steps=300)
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("sidecar").setLevel(logging.INFO)  # "checkpoint now: ..." and why

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16,
                   bos_token_id=0, eos_token_id=0)
    )
    training_args = TrainingArguments(
        output_dir=str(args.output),
        max_steps=args.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="no",  # the ESI save is the only one here; any strategy works
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=True,
    )
    client, line = follow(args.release_in)  # --release-in counts from here
    print(line, flush=True)
    # The callback builds its guard when training starts, with this policy and, under
    # torchrun, the reducer that makes every rank save at the same step.
    # EsiCheckpointCallback() alone does the same with the default policy (60 s + 120 s).
    esi = EsiCheckpointCallback(
        policy=policy(args), client=client, events=args.release_in is None,
    )
    trainer = Trainer(
        model=model, args=training_args, train_dataset=RandomTokens(), callbacks=[esi]
    )

    # The newest checkpoint-<step> the Trainer finished (get_last_checkpoint would also
    # return one a kill cut short).
    last = latest_complete_checkpoint(args.output)
    if last:  # checkpoint-<step>: model, optimizer, scheduler, RNG, trainer state
        print(f"start: resuming from step {last.rsplit('-', 1)[1]} ({last})", flush=True)
    else:
        print("start: from scratch", flush=True)
    trainer.train(resume_from_checkpoint=last)

    step = trainer.state.global_step
    status = esi.guard.status()  # built by the callback at the start of training
    saved = latest_complete_checkpoint(args.output)
    if esi.saves_requested and saved:  # the newest: the top-up save when there was one
        saved_step = int(saved.rsplit("-", 1)[1])
        print(f"saved: checkpoint at step {saved_step} -> {Path(saved).resolve()}")
    if esi.stopped:
        print(f"stop: step {step}")  # the guard logged why
    # Otherwise the run is complete: save your final model here as usual.
    print(f"done: trained {step}/{args.steps} steps; deadline from "
          f"{status.deadline_source or 'nowhere'}")
    if esi.stopped and saved:
        print(resume_line(args.output, saved_step))
    raise SystemExit(exit_status(esi.guard.released))


if __name__ == "__main__":
    main()
