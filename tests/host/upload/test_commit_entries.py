"""What a durable checkpoint offers the next one's unchanged files (commit_check.
durable_entries): each file where its bytes are, its own folder or the older folder an S3
reference points at. Found by the mutation check (docs/mutation.md): every file was
assumed to be in its own folder, which for a referenced file names bytes that are not there.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from sidecar.checkpoint.folders import atomic_checkpoint
from sidecar.checkpoint.manifest import read_manifest
from sidecar.host.upload.commit_check import DurableFile, durable_entries


def test_a_referenced_file_is_offered_where_its_bytes_are(tmp_path: Path) -> None:
    saving = atomic_checkpoint(tmp_path, 2, checksum=True)
    with saving as folder:
        (folder / "frozen.bin").write_bytes(b"f" * 100)
        (folder / "model.bin").write_bytes(b"m" * 50)
    info = read_manifest(tmp_path / saving.name)
    digest = {name: hashlib.sha256(data).hexdigest()
              for name, data in (("frozen.bin", b"f" * 100), ("model.bin", b"m" * 50))}
    entries = durable_entries(saving.name, info, {"frozen.bin": "step_00000001"})
    assert entries == {
        "frozen.bin": DurableFile("step_00000001", 100, digest["frozen.bin"]),
        "model.bin": DurableFile(saving.name, 50, digest["model.bin"]),
    }
    # Without references every file is in its own folder.
    assert {path: entry.checkpoint for path, entry in durable_entries(saving.name, info).items()} \
        == {"frozen.bin": saving.name, "model.bin": saving.name}
