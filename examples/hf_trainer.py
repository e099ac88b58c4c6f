"""A Hugging Face Trainer that saves before the machine is released, then stops.

    python examples/hf_trainer.py --steps 100000 --release-in 15 \\
        --save-seconds 1 --redundant-seconds 4     # trains a few s, saves, exits 75 (~30 s)
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
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from sidecar import EXIT_RELEASED, SavePolicy
from sidecar.integrations.transformers import EsiCheckpointCallback, latest_complete_checkpoint
from sidecar.train.client import SidecarClient
from sidecar.train.deadline import ENV_DEADLINE_VARIABLES
from sidecar.train.policy import DEFAULT_TOP_UP_SECONDS

DEFAULT_OUTPUT = Path("checkpoints") / "hf_trainer"  # under the working folder: it stays


class ReleaseInOnly(SidecarClient):
    """A client that never asks a daemon: with ``--release-in`` that deadline wins."""

    def expiry(self) -> None:
        self.last_error = "not asked: --release-in sets the deadline"
        return None


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
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps in all")
    parser.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        help="checkpoint-<step> folders go here; a rerun resumes from the newest "
        f"(default: ./{DEFAULT_OUTPUT})",
    )
    parser.add_argument(
        "--release-in",
        type=float,
        default=None,
        help="pretend the machine is released in this many seconds (sets "
        f"{ENV_DEADLINE_VARIABLES[0]} for this process); it wins over a running "
        "daemon, which is then not asked",
    )
    parser.add_argument("--save-seconds", type=float, default=60.0, help="assumed save time")
    parser.add_argument("--redundant-seconds", type=float, default=120.0, help="safety margin")
    parser.add_argument("--top-up-seconds", default=DEFAULT_TOP_UP_SECONDS,
                        type=lambda text: None if text == "off" else float(text),
                        help="margin of the top-up save after the final one ('off': none; "
                        f"default {DEFAULT_TOP_UP_SECONDS:g})")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("sidecar").setLevel(logging.INFO)  # "checkpoint now: ..." and why
    client = SidecarClient()
    if args.release_in is not None:
        os.environ[ENV_DEADLINE_VARIABLES[0]] = str(time.time() + args.release_in)
        client = ReleaseInOnly()
        at = time.strftime("%H:%M:%S", time.localtime(time.time() + args.release_in))
        print(f"deadline: --release-in {args.release_in:g} s (at {at}); no daemon is asked")
    else:
        print(f"deadline: the daemon's at {', '.join(client.urls)} "
              f"(without one: {' or '.join(ENV_DEADLINE_VARIABLES)})")

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
    # The callback builds its guard when training starts, with this policy and, under
    # torchrun, the reducer that makes every rank save at the same step.
    # EsiCheckpointCallback() alone does the same with the default policy (60 s + 120 s).
    esi = EsiCheckpointCallback(
        policy=SavePolicy(save_seconds=args.save_seconds, redundant_seconds=args.redundant_seconds,
                   top_up_seconds=args.top_up_seconds),
        client=client, events=args.release_in is None,
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
        # A few steps past the checkpoint, so the resumed run ends soon on any machine.
        print(f"resume: python {sys.argv[0]} --output {args.output} --steps {saved_step + 50}")
    if esi.guard.released:
        raise SystemExit(EXIT_RELEASED)


if __name__ == "__main__":
    main()
