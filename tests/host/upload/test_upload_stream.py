"""Upload while the save writes, and unchanged files never sent again (issue 23, items 1
and 2), on a mounted volume and on a real S3-protocol server (moto on loopback): files go
to a staging place that nothing can see while the save still writes, the checkpoint
becomes visible only once its manifest has landed and every file matched it, and the
faults (a file rewritten while it streams, a save that fails midway, a save whose manifest
never comes, a server-side copy that fails, a file that no longer matches its sha256)
never make visible a checkpoint that restore would pick and that is not complete and
correct.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from upload_support import MIB, S3Server, isolate_aws_env, wait_for

from sidecar.checkpoint import folders
from sidecar.checkpoint.folders import atomic_checkpoint, latest_valid
from sidecar.host.upload import transfer
from sidecar.host.upload.s3_refs import REFERENCES_NAME, read_references, source_key
from sidecar.host.upload.uploader import Uploader, UploaderConfig
from sidecar.host.upload.volume import VolumeDestination

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    isolate_aws_env(monkeypatch)
    yield
    folders._phase_hook = None
    transfer._phase_hook = None


class Target:
    """One destination as the tests see it: what is visible there, what is staged."""

    def __init__(self, kind: str, tmp_path: Path, s3: Optional[S3Server],
                 bucket: Any) -> None:
        self.kind = kind
        self.volume = tmp_path / "volume"
        self.s3, self.bucket = s3, bucket
        if kind == "volume":
            self.volume.mkdir()

    def uploader(self, root: Path, *, max_bandwidth: Optional[int] = None) -> Uploader:
        if self.kind == "volume":
            config = UploaderConfig(root=root, location=None, scan_interval_seconds=0.2,
                                    settle_seconds=0.2, backoff_base_seconds=0.05,
                                    backoff_cap_seconds=0.3)
            return Uploader(config, destination=VolumeDestination(self.volume, max_bandwidth))
        assert self.s3 is not None
        storage = self.s3.storage(max_bandwidth=max_bandwidth)
        config = UploaderConfig(root=root, location=self.bucket, storage=storage,
                                scan_interval_seconds=0.2, settle_seconds=0.2,
                                backoff_base_seconds=0.05, backoff_cap_seconds=0.3)
        return Uploader(config)

    def visible(self) -> list[str]:
        """Everything a reader can see there (the volume's hidden entries excepted)."""
        if self.kind == "volume":
            return sorted(str(path.relative_to(self.volume)) for path in self.volume.rglob("*")
                          if not path.relative_to(self.volume).parts[0].startswith("."))
        assert self.s3 is not None
        return self.s3.keys(self.bucket)

    def staged(self) -> list[str]:
        """The staged files of checkpoints not visible yet."""
        if self.kind == "volume":
            return sorted(str(path.relative_to(self.volume)) for path in self.volume.rglob("*")
                          if path.is_file() and path.relative_to(self.volume).parts[0]
                          .startswith(".tmp-"))
        assert self.s3 is not None
        return sorted(upload["Key"] for upload in self.s3.multipart_uploads(self.bucket))

    def content(self, name: str, relative: str) -> bytes:
        """The file as restore reads it (on S3, from the folder its references name)."""
        if self.kind == "volume":
            return (self.volume / name / relative).read_bytes()
        assert self.s3 is not None
        references = read_references(self.s3.client(), self.bucket, name)
        return self.s3.get(self.bucket, source_key(self.bucket, name, relative, references))

    def complete(self) -> Optional[int]:
        """The step restore would pick there, checked against its manifest."""
        if self.kind == "volume":
            info = latest_valid(self.volume, verify_checksums=True, clean=False)
            return None if info is None else info.step
        manifests = [key for key in self.visible() if key.endswith("MANIFEST.json")]
        return len(manifests) or None


@pytest.fixture(params=["volume", "s3"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    if request.param == "s3":
        s3 = request.getfixturevalue("s3")
        return Target("s3", tmp_path, s3, s3.bucket("stream-" + os.urandom(4).hex()))
    return Target("volume", tmp_path, None, None)


@contextmanager
def running(uploader: Uploader) -> Iterator[Uploader]:
    uploader.start()
    try:
        yield uploader
    finally:
        uploader.stop(timeout=5)


def state(uploader: Uploader, name: str) -> Optional[str]:
    record = uploader.tracker.get(name)
    return record.state if record else None


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_files_go_while_the_save_writes_and_nothing_is_visible_before_the_manifest(
    target: Target, tmp_path: Path
) -> None:
    root = tmp_path / "local"
    first, second = os.urandom(6 * MIB), os.urandom(3 * MIB)
    with running(target.uploader(root)) as uploader:
        save = atomic_checkpoint(root, 10, checksum=True)
        with save as folder:
            (folder / "a.bin").write_bytes(first)
            (folder / "sub").mkdir()
            (folder / "sub" / "b.bin").write_bytes(second)
            # Both files are at the destination's staging place before the save ends,
            # and a reader sees nothing of the checkpoint there.
            wait_for(lambda: len(target.staged()) == 2, timeout=20)
            assert [name for name in target.visible() if "step_00000010" in name] == []
        wait_for(lambda: state(uploader, "step_00000010") == "done", timeout=20)
        record = uploader.tracker.get("step_00000010")
    assert record is not None and record.bytes_after_save == 0  # all sent while it saved
    assert target.content("step_00000010", "a.bin") == first
    assert target.content("step_00000010", "sub/b.bin") == second
    assert target.complete() == (10 if target.kind == "volume" else 1)
    assert target.staged() == []


def test_a_file_rewritten_while_it_streams_is_sent_again(target: Target, tmp_path: Path) -> None:
    root = tmp_path / "local"
    final = os.urandom(4 * MIB)
    with running(target.uploader(root, max_bandwidth=2 * MIB)) as uploader:
        with atomic_checkpoint(root, 3, checksum=True) as folder:
            (folder / "model.pt").write_bytes(os.urandom(4 * MIB))
            # 2 s at 2 MiB/s: rewritten (same size) while its first bytes are on their way.
            wait_for(lambda: target.staged(), timeout=20)
            with open(folder / "model.pt", "r+b") as handle:
                handle.write(final)
        wait_for(lambda: state(uploader, "step_00000003") == "done", timeout=30)
    assert sha(target.content("step_00000003", "model.pt")) == sha(final)
    assert target.staged() == []


def test_a_save_that_fails_midway_leaves_nothing_at_the_destination(
    target: Target, tmp_path: Path
) -> None:
    """The checkpoint folder deleted mid-upload (the save raised: atomic_checkpoint
    removes its temporary folder): the staged files go, nothing becomes visible."""
    root = tmp_path / "local"
    with running(target.uploader(root, max_bandwidth=2 * MIB)) as uploader:
        with pytest.raises(RuntimeError), atomic_checkpoint(root, 4) as folder:
            (folder / "done.bin").write_bytes(os.urandom(MIB))
            (folder / "big.bin").write_bytes(os.urandom(6 * MIB))
            wait_for(lambda: target.staged(), timeout=20)
            raise RuntimeError("the save failed")
        wait_for(lambda: target.staged() == [], timeout=20)
        assert target.visible() == []
        # The next save goes up as usual.
        with atomic_checkpoint(root, 5) as folder:
            (folder / "w.bin").write_bytes(b"x" * 1000)
        wait_for(lambda: state(uploader, "step_00000005") == "done", timeout=20)
    assert target.complete() == (5 if target.kind == "volume" else 1)
    assert not any("step_00000004" in name for name in target.visible())


_KILLED_SAVE = textwrap.dedent("""
    import os, sys, threading
    from sidecar.checkpoint.folders import atomic_checkpoint
    with atomic_checkpoint(sys.argv[1], 6) as folder:
        (folder / "a.bin").write_bytes(os.urandom(1 << 20))
        print("written", flush=True)
        threading.Event().wait()
""")


def test_a_save_whose_manifest_never_comes_is_never_visible_and_is_cleaned_up(
    target: Target, tmp_path: Path
) -> None:
    root = tmp_path / "local"
    root.mkdir()
    with running(target.uploader(root)) as uploader:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        trainer = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(root)],
                                   stdout=subprocess.PIPE, text=True, env=env)
        assert trainer.stdout is not None and trainer.stdout.readline().strip() == "written"
        wait_for(lambda: target.staged(), timeout=20)
        trainer.send_signal(signal.SIGKILL)  # killed mid-save: the manifest never comes
        trainer.wait(10)
        assert target.visible() == []
        # The next save cleans the dead writer's folder: its staged upload goes with it.
        with atomic_checkpoint(root, 7) as folder:
            (folder / "w.bin").write_bytes(b"y" * 100)
        wait_for(lambda: state(uploader, "step_00000007") == "done", timeout=20)
        wait_for(lambda: target.staged() == [], timeout=20)
    assert not any("step_00000006" in name for name in target.visible())


def test_a_file_that_no_longer_matches_its_sha256_is_never_committed(
    target: Target, tmp_path: Path
) -> None:
    """A hash mismatch at the commit: the copy sent early matched, but the file changed
    (same size) after the save hashed it, so the file and its manifest disagree; it is
    read again, still disagrees, and the checkpoint is never made visible."""
    root = tmp_path / "local"

    def spoil(phase: str, detail: str) -> None:
        if phase == "manifest-written":
            for temp in root.glob(".tmp-step_00000008.*"):
                with open(temp / "model.pt", "r+b") as handle:
                    handle.write(b"\0" * 16)

    with running(target.uploader(root)) as uploader:
        with atomic_checkpoint(root, 8, checksum=True) as folder:
            (folder / "model.pt").write_bytes(os.urandom(MIB))
            wait_for(lambda: target.staged(), timeout=20)
            folders._phase_hook = spoil
        wait_for(lambda: state(uploader, "step_00000008") == "failed", timeout=20)
        failed = uploader.tracker.get("step_00000008")
    assert failed is not None and "sha256 differs" in (failed.error or "")
    assert target.visible() == []
    assert target.staged() == []
    assert uploader.tracker.last_durable() is None


def bytes_sent(uploader: Uploader) -> float:
    """``esi_sidecar_upload_bytes_total``: every byte sent, streamed ones included."""
    for metric in uploader.tracker.collect():
        if metric.name == "esi_sidecar_upload_bytes":
            return float(metric.samples[0].value)
    raise AssertionError("no esi_sidecar_upload_bytes metric")


def checkpoint(root: Path, step: int, files: dict[str, bytes], checksum: bool = True) -> None:
    with atomic_checkpoint(root, step, checksum=checksum) as folder:
        for relative, data in files.items():
            (folder / relative).write_bytes(data)


@pytest.mark.parametrize("checksum", [True, False], ids=["manifest-sha256", "hashed-here"])
def test_an_unchanged_file_is_not_sent_again(
    target: Target, tmp_path: Path, checksum: bool
) -> None:
    root = tmp_path / "local"
    frozen, weights = os.urandom(4 * MIB), os.urandom(MIB)
    at_commit: list[list[str]] = []
    with running(target.uploader(root)) as uploader:
        checkpoint(root, 1, {"frozen.bin": frozen, "weights.bin": weights}, checksum)
        wait_for(lambda: state(uploader, "step_00000001") == "done", timeout=20)
        before = bytes_sent(uploader)
        assert before >= 5 * MIB

        def seen(phase: str, detail: object) -> None:
            if phase == "manifest-written" and detail == "step_00000002":
                at_commit.append(target.visible())

        transfer._phase_hook = seen
        changed = os.urandom(MIB)
        checkpoint(root, 2, {"frozen.bin": frozen, "weights.bin": changed}, checksum)
        wait_for(lambda: state(uploader, "step_00000002") == "done", timeout=20)
        sent = uploader.tracker.get("step_00000002")
        # The changed file only (sent once, or again if it was caught half-written),
        # never the 4 MiB frozen one.
        assert bytes_sent(uploader) - before < 4 * MIB
        if target.kind == "s3":  # then copied into its own folder while idle
            own = target.bucket.key("step_00000002", "frozen.bin")
            refs = target.bucket.key("step_00000002", REFERENCES_NAME)
            wait_for(lambda: own in target.visible() and refs not in target.visible(),
                     timeout=20)
    assert sent is not None and sent.bytes_after_save is not None
    assert sent.bytes_after_save <= MIB
    if target.kind == "s3":
        # Durable with the frozen file still only in step 1's folder, by reference.
        assert at_commit and own not in at_commit[0] and refs in at_commit[0]
        target.s3.client().delete_object(  # type: ignore[union-attr]
            Bucket=target.bucket.bucket, Key=target.bucket.key("step_00000001", "frozen.bin"))
    assert target.content("step_00000002", "frozen.bin") == frozen
    assert target.content("step_00000002", "weights.bin") == changed
    if target.kind == "volume":  # a hard link: each checkpoint owns its file
        first, second = (os.stat(target.volume / f"step_0000000{n}" / "frozen.bin")
                         for n in (1, 2))
        assert first.st_ino == second.st_ino
        assert latest_valid(target.volume, verify_checksums=True, clean=False).step == 2  # type: ignore[union-attr]


def test_a_server_side_copy_that_fails_sends_the_bytes(target: Target, tmp_path: Path) -> None:
    """The durable file an unchanged one would be copied from is gone at the destination
    (the copy, a hard link or UploadPartCopy, fails): its bytes are sent instead."""
    root = tmp_path / "local"
    frozen = os.urandom(2 * MIB)
    remove: Callable[[], None]
    if target.kind == "volume":
        def remove() -> None:
            (target.volume / "step_00000001" / "frozen.bin").unlink()
    else:
        def remove() -> None:
            assert target.s3 is not None
            target.s3.client().delete_object(
                Bucket=target.bucket.bucket, Key=target.bucket.key("step_00000001", "frozen.bin"))
    with running(target.uploader(root)) as uploader:
        checkpoint(root, 1, {"frozen.bin": frozen})
        wait_for(lambda: state(uploader, "step_00000001") == "done", timeout=20)
        remove()
        checkpoint(root, 2, {"frozen.bin": frozen})
        wait_for(lambda: state(uploader, "step_00000002") == "done", timeout=20)
    assert target.content("step_00000002", "frozen.bin") == frozen
    assert target.staged() == []
