"""A manifest is what the job wrote, and the root daemon parses it (issue 35): whatever it
holds, it makes its folder an invalid checkpoint with a reason, and nothing else. A
manifest nested 200,000 deep once raised RecursionError out of ``list_checkpoints`` (so
out of the uploader's every scan, and out of the job's own ``atomic_checkpoint``); a
sparse one of gigabytes was read whole into the daemon's memory.
"""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

from sidecar.checkpoint.folders import atomic_checkpoint, latest_valid, list_checkpoints
from sidecar.checkpoint.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES
from sidecar.host.upload.jobfiles import Refused, read_job_file


def saved(root: Path, step: int) -> None:
    with atomic_checkpoint(root, step) as folder:
        (folder / "model.pt").write_bytes(b"weights")


def planted(root: Path, name: str, manifest: bytes) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / MANIFEST_NAME).write_bytes(manifest)
    return folder


def sparse(folder: Path, size: int) -> Path:
    """A manifest of ``size`` bytes that costs no disk."""
    folder.mkdir()
    with open(folder / MANIFEST_NAME, "wb") as handle:
        handle.truncate(size)
    return folder


def reasons(root: Path) -> dict[str, str]:
    return {listing.path.name: listing.reason or "" for listing in list_checkpoints(root)}


def test_a_manifest_nested_too_deeply_is_an_invalid_checkpoint_with_a_reason(
    tmp_path: Path,
) -> None:
    saved(tmp_path, 1)
    planted(tmp_path, "step_00000009", b"[" * 200_000)
    assert "nests too deeply" in reasons(tmp_path)["step_00000009"]
    found = latest_valid(tmp_path, clean=False)
    assert found is not None and found.step == 1
    saved(tmp_path, 2)  # the job's own save beside it still commits
    assert reasons(tmp_path)["step_00000002"] == ""


def test_a_reason_shows_a_jobs_value_short_however_deep(tmp_path: Path) -> None:
    entry: list[object] = []
    for _ in range(400):
        entry = [entry]
    body = {"format": "esi-sidecar-checkpoint", "format_version": 1, "step": 3,
            "created_at": "2024-01-01T00:00:00Z", "files": [entry], "total_bytes": 0,
            "metadata": {}}
    planted(tmp_path, "step_00000003", json.dumps(body).encode())
    reason = reasons(tmp_path)["step_00000003"]
    assert "not an object" in reason and len(reason) < 200


def test_a_manifest_over_the_bound_is_refused_without_being_read(tmp_path: Path) -> None:
    folder = sparse(tmp_path / "step_00000009", MAX_MANIFEST_BYTES + 1)
    tracemalloc.start()
    try:
        reason = reasons(tmp_path)["step_00000009"]
        try:
            read_job_file(folder, MANIFEST_NAME)
        except Refused as exc:
            refused = str(exc)
        else:
            refused = ""
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"more than the {MAX_MANIFEST_BYTES}" in reason
    assert f"more than the {MAX_MANIFEST_BYTES}" in refused
    assert peak < MAX_MANIFEST_BYTES // 16  # neither read it


def test_a_manifest_under_the_bound_is_read(tmp_path: Path) -> None:
    folder = sparse(tmp_path / "step_00000009", 1000)
    assert len(read_job_file(folder, MANIFEST_NAME)) == 1000
    assert os.path.getsize(folder / MANIFEST_NAME) == 1000
