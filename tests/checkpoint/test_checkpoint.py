"""sidecar.checkpoint.folders: atomic commit, crash safety, validation, retention, RNG state.

Everything runs on real files under tmp_path. The crash tests run a real writer in a
subprocess and SIGKILL it at exact points of a save: the writer reports each phase on
stdout and waits for "go" on stdin (through the module's phase hook), so no test sleeps.
A SIGKILL leaves the page cache intact, so these tests check the ordering of the commit
(what a resume can see after a kill), not that fsync reached the platter.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest

from sidecar.checkpoint import folders as checkpoint
from sidecar.checkpoint.folders import (
    LATEST_NAME,
    MANIFEST_NAME,
    CheckpointError,
    CheckpointInfo,
    atomic_checkpoint,
    capture_rng_state,
    clean_leftovers,
    latest_valid,
    list_checkpoints,
    prune,
    restore_rng_state,
    validate,
)
from sidecar.checkpoint.leftovers import writer_tag
from sidecar.timeparse import parse_timestamp

REPO = Path(__file__).resolve().parents[2]


def save(root: Path, step: int, content: bytes = b"", **options: Any) -> CheckpointInfo:
    """A small two-file checkpoint (one in a sub-folder, like a DCP layout)."""
    ckpt = atomic_checkpoint(root, step, **options)
    with ckpt as folder:
        (folder / "model.bin").write_bytes(content or bytes([step % 256]) * 1000)
        (folder / "optim").mkdir()
        (folder / "optim" / "shard0.bin").write_bytes(b"o" * 300)
    assert ckpt.info is not None
    return ckpt.info


def hidden_entries(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir() if path.name.startswith("."))


# -- commit ---------------------------------------------------------------------------


def test_commit_writes_manifest_last_then_renames_then_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, bool, bool, Optional[str]]] = []
    root = tmp_path / "ckpt"
    final = root / "step_00000007"

    def record(phase: str, detail: str) -> None:
        temps = [p for p in root.iterdir() if p.name.startswith(".tmp-step_00000007.")]
        in_temp = bool(temps) and (temps[0] / MANIFEST_NAME).exists()
        pointer = (root / LATEST_NAME).read_text() if (root / LATEST_NAME).exists() else None
        seen.append((phase, in_temp, final.exists(), pointer))

    monkeypatch.setattr(checkpoint, "_phase_hook", record)
    info = save(root, 7, metadata={"loss": 1.5, "config": {"lr": 0.1}})

    phases = [entry[0] for entry in seen]
    assert phases == [
        "user-done",
        "file-synced",
        "file-synced",
        "tree-synced",
        "manifest-written",
        "renamed",
        "parent-synced",
        "pointer-updated",
    ]
    # No manifest until every file was synced; the folder appears only with it.
    assert all(not has_manifest for phase, has_manifest, _, _ in seen[:4])
    assert seen[4][1:3] == (True, False)
    assert seen[5][2] is True and seen[5][3] is None
    assert seen[7][3] == "step_00000007\n"

    manifest = json.loads((final / MANIFEST_NAME).read_text())
    assert manifest["format_version"] == 1
    assert manifest["step"] == 7
    assert manifest["created_at"].endswith("Z")
    assert parse_timestamp(manifest["created_at"]).when == info.created_at
    assert manifest["files"] == [
        {"path": "model.bin", "size": 1000},
        {"path": "optim/shard0.bin", "size": 300},
    ]
    assert manifest["total_bytes"] == 1300 == info.total_bytes
    assert manifest["metadata"] == {"loss": 1.5, "config": {"lr": 0.1}}
    assert info.path == final and info.step == 7
    assert hidden_entries(root) == []
    assert latest_valid(root) == info


def test_checksum_and_metadata_updated_inside_the_block(tmp_path: Path) -> None:
    ckpt = atomic_checkpoint(tmp_path, 3, checksum=True, metadata={"epoch": 1})
    with ckpt as folder:
        (folder / "weights.safetensors").write_bytes(b"w" * 4096)
        ckpt.metadata["loss"] = 0.25
    assert ckpt.info is not None
    (entry,) = ckpt.info.files
    assert entry.sha256 is not None and len(entry.sha256) == 64
    assert ckpt.info.metadata == {"epoch": 1, "loss": 0.25}
    assert validate(ckpt.info.path, verify_checksums=True) == ckpt.info


def test_name_override_for_other_layouts(tmp_path: Path) -> None:
    info = save(tmp_path, 12, name="global_step_12")
    assert info.path == tmp_path / "global_step_12"
    assert (tmp_path / LATEST_NAME).read_text() == "global_step_12\n"
    assert latest_valid(tmp_path) == info
    with pytest.raises(ValueError):
        atomic_checkpoint(tmp_path, 1, name="../escape")
    with pytest.raises(ValueError):
        atomic_checkpoint(tmp_path, 1, name=LATEST_NAME)


def test_bad_arguments_fail_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="JSON"):
        atomic_checkpoint(tmp_path, 1, metadata={"when": object()})
    with pytest.raises(ValueError, match="step"):
        atomic_checkpoint(tmp_path, -1)
    with pytest.raises(ValueError, match="keep_last"):
        atomic_checkpoint(tmp_path, 1, keep_last=0)
    assert list(tmp_path.iterdir()) == []


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    save(tmp_path, 5, b"A" * 100)
    info = save(tmp_path, 5, b"B" * 200)
    assert (info.path / "model.bin").read_bytes() == b"B" * 200
    assert latest_valid(tmp_path) == info
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST_NAME, "step_00000005"]


def test_exception_in_the_block_leaves_no_checkpoint_and_no_temp(tmp_path: Path) -> None:
    previous = save(tmp_path, 1)
    with pytest.raises(RuntimeError, match="disk on fire"), atomic_checkpoint(tmp_path, 2) as d:
        (d / "model.bin").write_bytes(b"half")
        raise RuntimeError("disk on fire")
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST_NAME, "step_00000001"]
    assert (tmp_path / LATEST_NAME).read_text() == "step_00000001\n"
    assert latest_valid(tmp_path) == previous


def test_saving_an_older_step_does_not_move_the_pointer_back(tmp_path: Path) -> None:
    save(tmp_path, 10)
    save(tmp_path, 4)
    assert (tmp_path / LATEST_NAME).read_text() == "step_00000010\n"
    found = latest_valid(tmp_path)
    assert found is not None and found.step == 10


# -- free disk ------------------------------------------------------------------------


def fake_usage(free: int) -> Any:
    return lambda path: SimpleNamespace(total=10 * free + 1, used=0, free=free)


def test_free_disk_check_fails_early_with_numbers(tmp_path: Path) -> None:
    previous = save(tmp_path, 1)  # 1300 bytes
    needed = math.ceil(previous.total_bytes * 1.1)
    with pytest.raises(CheckpointError) as caught:
        atomic_checkpoint(tmp_path, 2, disk_usage=fake_usage(1000)).__enter__()
    message = str(caught.value)
    assert str(tmp_path / "step_00000002") in message
    assert f"needs {needed} bytes" in message
    assert "1000 bytes" in message and "step_00000001" in message
    assert hidden_entries(tmp_path) == []  # failed before creating anything

    with atomic_checkpoint(tmp_path, 2, disk_usage=fake_usage(10_000)) as folder:
        (folder / "x").write_bytes(b"x")


def test_min_free_bytes_applies_without_a_previous_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"needs 5000 bytes.*only 4999 bytes"):
        atomic_checkpoint(tmp_path, 1, min_free_bytes=5000, disk_usage=fake_usage(4999)).__enter__()


# -- validation and discovery -----------------------------------------------------------


def _truncate(info: CheckpointInfo) -> None:
    with open(info.path / "model.bin", "r+b") as handle:
        handle.truncate(10)


def _grow(info: CheckpointInfo) -> None:
    with open(info.path / "optim" / "shard0.bin", "ab") as handle:
        handle.write(b"extra")


def _flip_byte(info: CheckpointInfo) -> None:
    path = info.path / "model.bin"
    data = bytearray(path.read_bytes())
    data[500] ^= 0xFF
    path.write_bytes(bytes(data))


def _garbage_manifest(info: CheckpointInfo) -> None:
    (info.path / MANIFEST_NAME).write_bytes(b'{"format": "esi-sidecar-checkpoint", "ste')


def _wrong_total(info: CheckpointInfo) -> None:
    path = info.path / MANIFEST_NAME
    body = json.loads(path.read_text())
    body["total_bytes"] += 1
    path.write_text(json.dumps(body))


CORRUPTIONS = {
    "truncated": (_truncate, "model.bin is 10 bytes, the manifest says 1000", False),
    "grown": (_grow, "shard0.bin is 305 bytes, the manifest says 300", False),
    "sha-mismatch": (_flip_byte, "model.bin does not match its sha256", True),
    "missing-file": (
        lambda info: (info.path / "optim" / "shard0.bin").unlink(),
        "optim/shard0.bin listed in the manifest is missing",
        False,
    ),
    "garbage-manifest": (_garbage_manifest, "not valid JSON", False),
    "manifest-missing": (
        lambda info: (info.path / MANIFEST_NAME).unlink(),
        "no MANIFEST.json",
        False,
    ),
    "inconsistent-manifest": (_wrong_total, "total_bytes does not match", False),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_checkpoints_are_skipped_with_a_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    corrupt, reason, needs_checksums = CORRUPTIONS[kind]
    older = save(tmp_path, 1, checksum=True)
    newer = save(tmp_path, 2, checksum=True)
    corrupt(newer)

    if needs_checksums:  # same sizes: only the hash can tell
        assert latest_valid(tmp_path) == newer
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sidecar.checkpoint"):
        assert latest_valid(tmp_path, verify_checksums=needs_checksums) == older
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 1
    assert "step_00000002" in skipped[0] and reason in skipped[0]

    with pytest.raises(CheckpointError, match="step_00000002") as caught:
        validate(newer.path, verify_checksums=needs_checksums)
    assert reason in caught.value.reason
    listing = list_checkpoints(tmp_path, verify_checksums=needs_checksums)
    assert [(item.step, item.valid) for item in listing] == [(2, False), (1, True)]
    assert listing[0].reason is not None and reason in listing[0].reason


def test_partial_folders_and_foreign_folders(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    older = save(tmp_path, 1)
    (tmp_path / "step_00000009").mkdir()  # a step-like folder with no manifest
    (tmp_path / "step_00000009" / "model.bin").write_bytes(b"half")
    (tmp_path / "tensorboard").mkdir()  # not a checkpoint at all: not even listed
    with caplog.at_level(logging.WARNING, logger="sidecar.checkpoint"):
        assert latest_valid(tmp_path) == older
    assert any(
        "step_00000009" in r.getMessage() and "no MANIFEST" in r.getMessage()
        for r in caplog.records
    )
    assert [item.path.name for item in list_checkpoints(tmp_path)] == [
        "step_00000009",
        "step_00000001",
    ]


def test_same_step_ordered_by_created_time(tmp_path: Path) -> None:
    save(tmp_path, 4, name="a_step_4")
    second = save(tmp_path, 4, name="b_step_4")
    assert latest_valid(tmp_path) == second


def test_pointer_at_a_deleted_folder_falls_back_to_scanning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    older = save(tmp_path, 1)
    newer = save(tmp_path, 2)
    shutil.rmtree(newer.path)
    assert (tmp_path / LATEST_NAME).read_text() == "step_00000002\n"
    with caplog.at_level(logging.WARNING, logger="sidecar.checkpoint"):
        assert latest_valid(tmp_path) == older
    assert any("step_00000002 (missing)" in r.getMessage() for r in caplog.records)

    (tmp_path / LATEST_NAME).write_bytes(b"\xff\xfe garbage")
    assert latest_valid(tmp_path) == older
    (tmp_path / LATEST_NAME).unlink()
    assert latest_valid(tmp_path) == older


def test_no_checkpoint_at_all(tmp_path: Path) -> None:
    assert latest_valid(tmp_path / "missing") is None
    assert latest_valid(tmp_path) is None
    assert list_checkpoints(tmp_path) == []


# -- retention ---------------------------------------------------------------------------


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))


def test_keep_last_keeps_the_newest_n(tmp_path: Path) -> None:
    for step in range(1, 6):
        save(tmp_path, step, keep_last=2)
    assert names(tmp_path) == ["step_00000004", "step_00000005"]
    assert hidden_entries(tmp_path) == []


def test_retention_never_deletes_pinned_or_protected(tmp_path: Path) -> None:
    for step in range(1, 5):
        save(tmp_path, step)
    (tmp_path / "step_00000001" / ".uploading").write_text("")
    (tmp_path / "step_00000002" / ".keep").write_text("")
    # Pin markers appear after the commit and do not make a checkpoint invalid.
    assert validate(tmp_path / "step_00000001").step == 1
    removed = prune(tmp_path, 1, protect=lambda info: info.step == 3)
    assert removed == []
    assert names(tmp_path) == [f"step_0000000{n}" for n in range(1, 5)]

    (tmp_path / "step_00000002" / ".keep").unlink()
    save(tmp_path, 5, keep_last=1)
    assert names(tmp_path) == ["step_00000001", "step_00000005"]


def test_pinned_checkpoints_do_not_use_up_keep_last(tmp_path: Path) -> None:
    for step in range(1, 6):
        save(tmp_path, step)
    (tmp_path / "step_00000005" / ".uploading").write_text("")  # the newest, uploading
    removed = prune(tmp_path, 2)
    # Two unpinned kept (4 and 3) besides the pinned newest: 5 must not count as one.
    assert sorted(p.name for p in removed) == ["step_00000001", "step_00000002"]
    assert names(tmp_path) == ["step_00000003", "step_00000004", "step_00000005"]


def test_prune_never_deletes_the_newest_valid_nor_invalid_folders(tmp_path: Path) -> None:
    save(tmp_path, 1)
    save(tmp_path, 2)
    broken = save(tmp_path, 3)
    (broken.path / "model.bin").unlink()
    (tmp_path / LATEST_NAME).unlink()
    assert prune(tmp_path, 1) == [tmp_path / "step_00000001"]
    assert names(tmp_path) == ["step_00000002", "step_00000003"]
    with pytest.raises(ValueError):
        prune(tmp_path, 0)


# -- leftovers and their owners ------------------------------------------------------------


def leftover(root: Path, name: str, tag: str, kind: str = "tmp") -> Path:
    path = root / f".{kind}-{name}.{tag}.0123abcd"
    path.mkdir()
    (path / "model.bin").write_bytes(b"partial")
    return path


def test_leftovers_of_live_writers_are_kept_dead_ones_removed(tmp_path: Path) -> None:
    host, pid, start = writer_tag().split("-")
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(finished.stdout)
    other_host = "0" * 8 if host != "0" * 8 else "1" * 8

    live = leftover(tmp_path, "step_00000001", f"{host}-{pid}-{start}")
    dead = leftover(tmp_path, "step_00000002", f"{host}-{dead_pid}-1")
    reused = leftover(tmp_path, "step_00000003", f"{host}-{pid}-{int(start) + 1}")
    foreign_young = leftover(tmp_path, "step_00000004", f"{other_host}-{pid}-1")
    foreign_old = leftover(tmp_path, "step_00000005", f"{other_host}-{pid}-1")
    old_time = (foreign_old / "model.bin").stat().st_mtime - 7200
    for path in (foreign_old / "model.bin", foreign_old):
        os.utime(path, (old_time, old_time))

    removed = clean_leftovers(tmp_path)
    assert sorted(removed) == sorted([dead, reused, foreign_old])
    assert live.exists() and foreign_young.exists()
    # A save in progress is invisible to resume and untouched by it.
    assert latest_valid(tmp_path) is None
    assert live.exists()


def test_a_folder_moved_aside_by_a_killed_resave_is_restored(tmp_path: Path) -> None:
    info = save(tmp_path, 5)
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    host = writer_tag().split("-")[0]
    aside = tmp_path / f".old-step_00000005.{host}-{int(finished.stdout)}-1.0123abcd"
    os.rename(info.path, aside)
    assert latest_valid(tmp_path) == info
    assert hidden_entries(tmp_path) == []


# -- kill -9 at every point of a save ------------------------------------------------------

WRITER = r"""
import json, os, sys
from sidecar.checkpoint import folders as checkpoint

args = json.loads(sys.argv[1])

def pause(phase, detail=""):
    sys.stdout.write(f"{phase} {detail}\n")
    sys.stdout.flush()
    if sys.stdin.readline() != "go\n":
        os._exit(3)

checkpoint._phase_hook = pause


class Reporting:
    # A file object that reports every `every` bytes that torch.save writes through it.
    def __init__(self, handle, every):
        self.handle, self.every, self.count, self.mark = handle, every, 0, every

    def write(self, data):
        written = self.handle.write(data)
        self.count += written
        if self.count >= self.mark:
            self.handle.flush()
            self.mark += self.every
            pause("user-chunk", str(self.count))
        return written

    def flush(self):
        self.handle.flush()


ckpt = checkpoint.atomic_checkpoint(args["root"], args["step"], keep_last=args["keep_last"])
with ckpt as folder:
    if args["mode"] == "torch":
        import torch
        state = {"step": args["step"], "weights": torch.full((args["numel"],), args["fill"])}
        with open(folder / "model.pt", "wb") as raw:
            torch.save(state, Reporting(raw, args["every"]))
    else:
        for index in range(args["files"]):
            part = folder / f"shard{index % 2}" / f"part{index}.bin"
            part.parent.mkdir(exist_ok=True)
            with open(part, "wb") as handle:
                for _ in range(args["chunks"]):
                    handle.write(bytes([args["fill"]]) * args["chunk_bytes"])
                    handle.flush()
                    pause("user-chunk", part.name)
pause("done")
"""


def run_writer(args: dict[str, Any], kill_at: Optional[tuple[str, int]]) -> list[str]:
    """Run WRITER; SIGKILL it when it reports ``kill_at`` (phase, n-th occurrence)."""
    defaults = {"keep_last": None, "files": 4, "chunks": 4, "chunk_bytes": 256 << 10}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, json.dumps({**defaults, **args})],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    watchdog = threading.Timer(60, proc.kill)
    watchdog.start()
    seen: list[str] = []
    counts: Counter[str] = Counter()
    assert proc.stdin is not None and proc.stdout is not None
    try:
        for line in proc.stdout:
            phase = line.split(" ", 1)[0]
            counts[phase] += 1
            seen.append(phase)
            if kill_at == (phase, counts[phase]):
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                return seen
            proc.stdin.write("go\n")
            proc.stdin.flush()
    finally:
        watchdog.cancel()
        proc.stdout.close()
        proc.stdin.close()
    assert proc.wait() == 0
    assert kill_at is None, f"the writer never reached {kill_at}; it went {seen}"
    return seen


def assert_bytes_checkpoint(info: Optional[CheckpointInfo], step: int, fill: int) -> None:
    """What a resume would do: load every file, and check it holds what was written."""
    assert info is not None and info.step == step
    assert len(info.files) == 4
    for entry in info.files:
        data = (info.path / entry.path).read_bytes()
        assert data == bytes([fill]) * (4 * (256 << 10))


# (phase, occurrence, step latest_valid must return). Before the rename the previous
# checkpoint (step 1) is the newest valid; from the rename on, the new one (step 2).
NEW_STEP_KILLS = [
    ("user-chunk", 1, 1),
    ("user-chunk", 9, 1),
    ("user-done", 1, 1),
    ("file-synced", 1, 1),
    ("file-synced", 3, 1),
    ("tree-synced", 1, 1),
    ("manifest-written", 1, 1),
    ("renamed", 1, 2),
    ("parent-synced", 1, 2),
    ("pointer-updated", 1, 2),
    ("retired", 1, 2),
]


@pytest.mark.parametrize(("phase", "occurrence", "expected"), NEW_STEP_KILLS)
def test_kill_during_a_new_save(tmp_path: Path, phase: str, occurrence: int, expected: int) -> None:
    chunk = 256 << 10
    with atomic_checkpoint(tmp_path, 1) as folder:
        for index in range(4):
            (folder / f"part{index}.bin").write_bytes(b"\x01" * (4 * chunk))
    args = {"root": str(tmp_path), "step": 2, "mode": "bytes", "fill": 2, "keep_last": 1}
    run_writer(args, kill_at=(phase, occurrence))

    if expected == 1:
        assert any(name.startswith(".tmp-step_00000002.") for name in hidden_entries(tmp_path))
    found = latest_valid(tmp_path)
    assert_bytes_checkpoint(found, expected, expected)
    assert hidden_entries(tmp_path) == []  # the killed writer's leftovers are gone


RESAVE_KILLS = [
    ("manifest-written", 1, 0xAA),
    ("old-moved-aside", 1, 0xAA),  # neither name holds it now; the next call restores
    ("renamed", 1, 0xBB),
    ("parent-synced", 1, 0xBB),
    ("old-removed", 1, 0xBB),
]


@pytest.mark.parametrize(("phase", "occurrence", "expected_fill"), RESAVE_KILLS)
def test_kill_during_a_resave_of_the_same_step(
    tmp_path: Path, phase: str, occurrence: int, expected_fill: int
) -> None:
    with atomic_checkpoint(tmp_path, 2) as folder:
        for index in range(4):
            (folder / f"part{index}.bin").write_bytes(b"\xaa" * (4 << 18))
    args = {"root": str(tmp_path), "step": 2, "mode": "bytes", "fill": 0xBB}
    run_writer(args, kill_at=(phase, occurrence))
    assert_bytes_checkpoint(latest_valid(tmp_path), 2, expected_fill)
    assert hidden_entries(tmp_path) == []


def test_leftover_is_cleaned_by_the_next_save(tmp_path: Path) -> None:
    run_writer(
        {"root": str(tmp_path), "step": 1, "mode": "bytes", "fill": 1}, kill_at=("user-chunk", 5)
    )
    assert len(hidden_entries(tmp_path)) == 1
    save(tmp_path, 2)
    assert hidden_entries(tmp_path) == []


@pytest.mark.parametrize("kill_at", [("user-chunk", 2), ("manifest-written", 1), None])
def test_kill_during_torch_save_never_leaves_an_unloadable_checkpoint(
    tmp_path: Path, kill_at: Optional[tuple[str, int]]
) -> None:
    torch = pytest.importorskip("torch")
    with atomic_checkpoint(tmp_path, 1) as folder:
        torch.save({"step": 1, "weights": torch.full((1 << 20,), 1.0)}, folder / "model.pt")
    args = {
        "root": str(tmp_path),
        "step": 2,
        "mode": "torch",
        "fill": 2.0,
        "numel": 1 << 20,
        "every": 1 << 20,
    }
    seen = run_writer(args, kill_at=kill_at)
    if kill_at is None:
        assert seen.count("user-chunk") >= 3  # torch.save really wrote through the hook

    found = latest_valid(tmp_path, verify_checksums=True)
    assert found is not None
    state = torch.load(found.path / "model.pt", weights_only=True)
    expected = 1 if kill_at is not None else 2
    assert found.step == state["step"] == expected
    assert torch.equal(state["weights"], torch.full((1 << 20,), float(expected)))
    assert hidden_entries(tmp_path) == []


# -- RNG -------------------------------------------------------------------------------------


def test_python_rng_round_trip_through_json() -> None:
    random.seed(1234)
    state = json.loads(json.dumps(capture_rng_state()))
    expected = [random.random() for _ in range(5)]
    random.seed(999)
    restore_rng_state(state)
    assert [random.random() for _ in range(5)] == expected


def test_numpy_rng_round_trip() -> None:
    numpy = pytest.importorskip("numpy")
    numpy.random.seed(7)
    numpy.random.normal()  # leaves a cached gaussian in the legacy state
    state = json.loads(json.dumps(capture_rng_state()))
    expected = numpy.random.normal(size=5)
    numpy.random.seed(8)
    restore_rng_state(state)
    assert numpy.array_equal(numpy.random.normal(size=5), expected)


def test_torch_rng_round_trip_through_torch_save(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(42)
    random.seed(42)
    with atomic_checkpoint(tmp_path, 1) as folder:
        torch.save({"rng": capture_rng_state()}, folder / "state.pt")
    expected = (torch.rand(5), random.random())
    torch.manual_seed(0)
    random.seed(0)

    found = latest_valid(tmp_path)
    assert found is not None
    # weights_only=True is torch's default: the state must be plain data.
    restore_rng_state(torch.load(found.path / "state.pt", weights_only=True)["rng"])
    assert torch.equal(torch.rand(5), expected[0])
    assert random.random() == expected[1]


# -- import hygiene ----------------------------------------------------------------------------


def _top_level_modules_after(statement: str) -> set[str]:
    code = (
        f"import json, sys\n{statement}\n"
        "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return set(json.loads(result.stdout))


def test_importing_checkpoint_pulls_in_only_the_standard_library() -> None:
    # Compared with a bare interpreter, so site hooks (.pth files) do not count.
    loaded = (_top_level_modules_after("import sidecar.checkpoint.folders")
              - _top_level_modules_after(""))
    forbidden = {
        "torch",
        "numpy",
        "fastapi",
        "uvicorn",
        "pydantic",
        "starlette",
        "dateutil",
        "volcenginesdkcore",
        "volcenginesdkecs",
        "prometheus_client",
        "httpx",
    }
    assert "sidecar" in loaded
    assert loaded & forbidden == set()
    if sys.version_info >= (3, 10):
        assert loaded - set(sys.stdlib_module_names) == {"sidecar"}
