"""The Hugging Face and Lightning snippets of docs/integrations.md, run as written (issue 39,
item 3): a job copied from the docs must leave with exit status 75 when it stopped for the
release, or ``esi-sidecar run``, SkyPilot and a Kubernetes Job take it for finished.

Each snippet is taken from the markdown, given what it leaves to the reader (a tiny model,
its data, ``args``) and run in its own process with the real framework on CPU against a
real daemon whose release has just passed: the guard makes its best-effort save at the
first step, stops, and the script must exit 75 with that checkpoint on disk; the daemon
then has the job's ``finished`` event.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_harness import get_json, serve_daemon, wait_for

pytest.importorskip("torch")

pytestmark = pytest.mark.frameworks

DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
SUPPORT = Path(__file__).resolve().parents[1] / "support"

HF_PRELUDE = """
import sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

class TinyDataset(torch.utils.data.Dataset):
    def __init__(self):
        self.rows = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(0))
    def __len__(self):
        return len(self.rows)
    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "labels": self.rows[index]}

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                   n_positions=16))
args = TrainingArguments(output_dir="out", use_cpu=True, report_to=[], save_strategy="no",
                         logging_strategy="no", disable_tqdm=True, max_steps=400,
                         per_device_train_batch_size=2, dataloader_num_workers=0)
ds = TinyDataset()
"""

LIGHTNING_PRELUDE = """
import lightning
import torch
from torch.utils.data import TensorDataset
from tiny_lightning import TinyModule

model = TinyModule()
rows = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
datamodule = lightning.pytorch.LightningDataModule.from_datasets(
    train_dataset=TensorDataset(rows, rows.sum(dim=1, keepdim=True)), batch_size=4)
"""


def snippet(heading: str) -> str:
    """The first ``python`` block after ``heading`` in docs/integrations.md, as written."""
    text = DOCS.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    block = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert block is not None, f"no python block under {heading!r}"
    return block.group(1)


def run_snippet(tmp_path: Path, prelude: str, code: str) -> tuple[int, str, list[dict]]:
    """Run prelude + the docs' code against a daemon whose release passed a second ago:
    (exit status, output, the daemon's events)."""
    script = tmp_path / "job.py"
    script.write_text(prelude + "\n" + code, encoding="utf-8")
    release = time.time() - 1.0
    with serve_daemon(sources=("static",), expires_at=repr(release)) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        env = {**os.environ, "ESI_SIDECAR_URL": daemon.url,
               "PYTHONPATH": os.pathsep.join([str(SUPPORT), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        output = done.stdout + done.stderr
        events = wait_for(lambda: [e for e in get_json(daemon.url + "/v1/events")[1]["events"]
                                   if e["kind"] == "finished"] and
                          get_json(daemon.url + "/v1/events")[1]["events"], timeout=10)
    return done.returncode, output, events


def test_the_hugging_face_snippet_exits_75_on_a_release(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    code, output, events = run_snippet(tmp_path, HF_PRELUDE, snippet("## Hugging Face Trainer"))
    assert code == 75, output[-3000:]
    assert (tmp_path / "out" / "checkpoint-1" / "trainer_state.json").is_file(), output[-3000:]
    kinds = [e["kind"] for e in reversed(events)]
    assert kinds.index("stop") < kinds.index("finished"), kinds
    stop = next(e for e in events if e["kind"] == "stop")
    assert stop.get("released") is True, stop


def test_the_lightning_snippet_exits_75_on_a_release(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    code, output, events = run_snippet(tmp_path, LIGHTNING_PRELUDE, snippet("## Lightning"))
    assert code == 75, output[-3000:]
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["esi-epoch=0-step=1.ckpt"], (saved, output[-3000:])
    kinds = [e["kind"] for e in reversed(events)]
    assert kinds.index("stop") < kinds.index("finished"), kinds
