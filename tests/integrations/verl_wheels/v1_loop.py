"""Drive verl's real V1 training loop (``PPOTrainer.fit`` and ``PPOTrainer.step`` of the
installed wheel) with stub workers, as a program, and print what happened as JSON.

    python tests/integrations/verl_wheels/v1_loop.py \
        STEPS STEP_SECONDS SAVE_SECONDS SAVE_FREQ [install-first]

Run with the verl wheel on ``PYTHONPATH`` and ``ESI_SIDECAR_URL`` at a daemon; it prints
``READY`` once verl is imported and starts training at the next line on stdin. Only what
needs GPUs and Ray workers is stubbed: the rollout/update of one step (``_step_once``, a
sleep), the checkpoint save (``_save_checkpoint``, a sleep that records the step), and the
trainer's construction (``__init__``, which starts worker groups). The loop, its save_freq
rule, its hooks and its exit are verl's own.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import types
from pathlib import Path


def main() -> None:
    steps, step_seconds, save_seconds, save_freq = (
        int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
    install_first = len(sys.argv) > 5 and sys.argv[5] == "install-first"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    from sidecar.integrations import verl as esi_verl

    if install_first:
        esi_verl.install()
    import verl
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1 import trainer_base
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    if not install_first:
        esi_verl.install()

    config_path = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    config = OmegaConf.load(config_path)
    config.trainer.logger = []
    config.trainer.val_before_train = False
    config.trainer.test_freq = 0
    config.trainer.save_freq = save_freq
    config.trainer.total_epochs = 1
    config.trainer.esi_redundant_time = 2
    config.trainer.esi_save_seconds = save_seconds  # as +trainer.esi_save_seconds=... would
    config.global_profiler.steps = None
    config.data.train_batch_size = 1

    saves: list[int] = []
    steps_run: list[int] = []

    class StubTrainer(PPOTrainerSync):  # type: ignore[misc]
        def __init__(self) -> None:  # no worker groups: nothing here needs a GPU
            self.config = config
            self.global_steps = 0
            self.total_training_steps = steps
            self.steps_per_epoch = steps
            self.parameter_sync_step = 1

        def prepare_step(self) -> dict:
            return {}

        def _step_once(self, metrics: dict, timing_raw: dict, sample_batch_size: int):  # type: ignore[no-untyped-def]
            steps_run.append(self.global_steps)
            time.sleep(step_seconds)
            return trainer_base.KVBatchMeta(partition_id="train", keys=[], tags=[])

        def _save_checkpoint(self) -> None:
            time.sleep(save_seconds)
            saves.append(self.global_steps)

        def _reissue_inflight_prompts(self) -> int:
            return 0

        def _start_profiling(self) -> None:
            pass

        def _stop_profiling(self) -> None:
            pass

        def on_step_end(self) -> None:  # the sync trainer's: update the rollout weights
            pass

        def on_sample_end(self) -> None:
            pass

        def _consume_sync_metrics(self) -> dict:
            return {}

        def _compute_metrics(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            pass

        def _shutdown_dump_executor(self) -> None:
            pass

    # The transfer queue's client needs its Ray actors; the loop only clears the batch.
    trainer_base.tq = types.SimpleNamespace(kv_clear=lambda **kwargs: None)
    trainer = StubTrainer()
    wrapped = getattr(trainer_base.PPOTrainer.step, "__esi_sidecar_wrapped__", None) is not None
    print("READY", flush=True)  # imports done: the caller sets the release, then says go
    sys.stdin.readline()
    trainer.fit(agent_loop_manager=None)
    guard = trainer.__dict__.get("esi_sidecar_guard")
    print(json.dumps({
        "verl": verl.__version__ if hasattr(verl, "__version__") else None,
        "wrapped": wrapped,
        "steps_run": steps_run,
        "saves": saves,
        "released": bool(getattr(trainer, "esi_sidecar_released", False)),
        "reason": guard.status().reason if guard is not None else None,
        "final_step": guard.status().final_step if guard is not None else None,
        "top_up_step": guard.status().top_up_step if guard is not None else None,
        "total_training_steps": trainer.total_training_steps,
    }))


if __name__ == "__main__":
    main()
