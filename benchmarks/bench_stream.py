"""Streaming upload: time from save start to durable, uploading while the save writes vs
after it, and a second checkpoint whose large file did not change (issue 23).

Run: ``.venv/bin/python -m benchmarks.bench_stream [--size 2GiB] [--rate 32]`` (``main()``
returns the figures for ``python -m benchmarks --only stream``). Needs boto3 and
moto[server] for the S3 half.

A save of 8 files (2 GiB in all; ``--size`` scales it) is written with
``atomic_checkpoint`` at a capped rate (``--rate`` MiB/s, chunks of 4 MiB paced by the
uploader's own ``Throttle``), while the daemon's ``Uploader`` sends to a destination
capped at the same rate (``--upload-max-bandwidth``: the volume's throttle, the S3
parts' throttle): equal rates are the case where streaming has the most to win and the
least slack. Both ways run in the same process, one after the other, to a fresh
destination each: ``after the save`` (``UploaderConfig(stream=False)``, the behaviour
before issue 23: the upload starts once the checkpoint is committed) and ``while it
writes`` (the default). Each is timed from the save's start until the tracker says
durable; the ratio is that over max(write time, upload time), the upload time being the
measured upload of the first way. Destinations: a folder (the volume backend, on this
machine's disk) and moto's S3 server in a separate process on 127.0.0.1.

The second case: a checkpoint of a 1 GiB file (half of ``--size``) and a small one is
made durable, then a second one where only the small file changed (the manifest records
sha256, ``checksum=True``); the second's time from the end of its save to durable is
compared with the time the large file's upload took the first time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from benchmarks.bench_upload import _empty, _start_moto

MIB = 1 << 20
GIB = 1 << 30
FILES = 8
CHUNK = 4 * MIB
QUICK_SIZE = 256 * MIB


def _parse_size(text: str) -> int:
    units = {"gib": GIB, "mib": MIB, "g": GIB, "m": MIB}
    lowered = text.strip().lower()
    for suffix, factor in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * factor)
    return int(lowered)


def _write_save(root: Path, step: int, sizes: dict[str, int], rate: int,
                fixed: Optional[dict[str, bytes]] = None, checksum: bool = False) -> float:
    """Write one checkpoint at ``rate`` bytes per second; returns its seconds."""
    from sidecar.checkpoint.folders import atomic_checkpoint
    from sidecar.host.upload.volume_stage import Throttle

    pattern = os.urandom(CHUNK)
    started = time.monotonic()
    throttle = Throttle(rate)
    with atomic_checkpoint(root, step, checksum=checksum) as folder:
        for relative, size in sizes.items():
            with open(folder / relative, "wb") as handle:
                if fixed and relative in fixed:
                    handle.write(fixed[relative])
                    continue
                handle.write(os.urandom(16))  # every file differs from every other
                written = 16
                while written < size:
                    count = min(CHUNK, size - written)
                    handle.write(pattern[:count])
                    written += count
                    throttle(count)
    return time.monotonic() - started


def _durable(uploader: Any, name: str, timeout: float = 1800) -> None:
    deadline = time.monotonic() + timeout
    while True:
        record = uploader.tracker.get(name)
        if record is not None and record.state == "done":
            return
        if record is not None and record.state == "failed":
            raise RuntimeError(f"upload of {name} failed: {record.error}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} not durable after {timeout} s")
        time.sleep(0.01)


class _Destinations:
    """Makes a fresh uploader per run, to the volume folder or the S3 server."""

    def __init__(self, workdir: Path, endpoint: Optional[str], rate: int) -> None:
        self.workdir, self.endpoint, self.rate = workdir, endpoint, rate
        self._runs = 0

    def make(self, kind: str, root: Path, stream: bool) -> tuple[Any, Callable[[], None]]:
        from sidecar.host.upload.location import S3Location
        from sidecar.host.upload.storage import make_client
        from sidecar.host.upload.storage_config import StorageConfig
        from sidecar.host.upload.uploader import Uploader, UploaderConfig
        from sidecar.host.upload.volume import VolumeDestination

        self._runs += 1
        options = {"scan_interval_seconds": 0.2, "stream": stream, "settle_seconds": 0.5}
        if kind == "volume":
            volume = self.workdir / f"volume-{self._runs}"
            volume.mkdir()
            uploader = Uploader(UploaderConfig(root=root, location=None, **options),
                                destination=VolumeDestination(volume, self.rate))
            return uploader, lambda: shutil.rmtree(volume, ignore_errors=True)
        assert self.endpoint is not None
        storage = StorageConfig(endpoint=self.endpoint, access_key="bench", secret_key="bench",
                                max_bandwidth=self.rate, part_size=16 * MIB, concurrency=4)
        client = make_client(storage)
        bucket = f"bench-stream-{self._runs}"
        client.create_bucket(Bucket=bucket)
        uploader = Uploader(UploaderConfig(root=root, location=S3Location(bucket, "run"),
                                           storage=storage, **options))

        def clean() -> None:
            _empty(client, bucket)
            client.delete_bucket(Bucket=bucket)

        return uploader, clean


def _stream_case(dest: _Destinations, kind: str, size: int, rate: int) -> dict[str, Any]:
    sizes = {f"shard_{index}.bin": size // FILES for index in range(FILES)}
    result: dict[str, Any] = {}
    for way, stream in (("after the save", False), ("while it writes", True)):
        root = dest.workdir / f"local-{kind}-{int(stream)}"
        root.mkdir()
        uploader, clean = dest.make(kind, root, stream)
        uploader.start()
        try:
            started = time.monotonic()
            write = _write_save(root, 1, sizes, rate)
            _durable(uploader, "step_00000001")
            total = time.monotonic() - started
        finally:
            uploader.stop(timeout=10)
            clean()
            shutil.rmtree(root, ignore_errors=True)
        result[way] = {"write": write, "durable": total, "upload": total - write}
    upload = result["after the save"]["upload"]
    base = max(result["while it writes"]["write"], upload)
    result["ratio"] = result["while it writes"]["durable"] / base
    result["old_ratio"] = result["after the save"]["durable"] / base
    return result


def _unchanged_case(dest: _Destinations, kind: str, size: int, rate: int) -> dict[str, Any]:
    big = size // 2
    root = dest.workdir / f"local-{kind}-unchanged"
    root.mkdir()
    uploader, clean = dest.make(kind, root, True)
    uploader.start()
    try:
        frozen = os.urandom(16) + b"\0" * (big - 16)
        _write_save(root, 1, {"frozen.bin": big, "small.bin": MIB}, rate,
                    fixed={"frozen.bin": frozen}, checksum=True)
        _durable(uploader, "step_00000001")
        first = uploader.tracker.get("step_00000001").duration_seconds
        saved = time.monotonic()
        _write_save(root, 2, {"frozen.bin": big, "small.bin": MIB}, rate,
                    fixed={"frozen.bin": frozen}, checksum=True)
        ended = time.monotonic()
        _durable(uploader, "step_00000002")
        durable = time.monotonic()
        second = uploader.tracker.get("step_00000002")
    finally:
        uploader.stop(timeout=10)
        clean()
        shutil.rmtree(root, ignore_errors=True)
    alone = big / rate  # the large file's upload at the cap, the first time
    return {"first_upload": first, "frozen_upload": alone,
            "second_after_save": durable - ended, "second_save": ended - saved,
            "second_bytes_after_save": second.bytes_after_save,
            "ratio": (durable - ended) / alone}


def _measure(size: int, rate: int, kinds: tuple[str, ...]) -> dict[str, Any]:
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    server = None
    endpoint = None
    if "s3" in kinds:
        server, endpoint = _start_moto()
    try:
        with tempfile.TemporaryDirectory(prefix="bench-stream-") as workdir:
            dest = _Destinations(Path(workdir), endpoint, rate)
            figures: dict[str, Any] = {"bytes": size, "rate": rate, "files": FILES}
            for kind in kinds:
                figures[kind] = {"stream": _stream_case(dest, kind, size, rate),
                                 "unchanged": _unchanged_case(dest, kind, size, rate)}
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
    return figures


def main(quick: bool = False, size: Optional[int] = None, rate_mib: float = 32.0,
         kinds: tuple[str, ...] = ("volume", "s3")) -> dict[str, Any]:
    """Run the benchmark, print a summary, and return the figures (and a report)."""
    size = size or (QUICK_SIZE if quick else 2 * GIB)
    rate = int(rate_mib * MIB)
    figures = _measure(size, rate, kinds)
    rows, targets = [], []
    for kind in kinds:
        stream, unchanged = figures[kind]["stream"], figures[kind]["unchanged"]
        for way in ("after the save", "while it writes"):
            run = stream[way]
            base = max(stream["while it writes"]["write"], stream["after the save"]["upload"])
            rows.append([kind, way, f"{run['write']:.1f}", f"{run['durable']:.1f}",
                         f"{run['durable'] / base:.2f}"])
        targets.append({
            "target": f"{kind}: save start to durable <= 1.15 x max(write, upload)",
            "measured": f"{stream['ratio']:.2f} x (after the save: {stream['old_ratio']:.2f} x)",
            "met": stream["ratio"] <= 1.15})
        targets.append({
            "target": f"{kind}: a second checkpoint whose {size // 2 // MIB} MiB file did not "
                      "change is durable in <= 5 % of that file's upload",
            "measured": f"{unchanged['ratio'] * 100:.1f} % "
                        f"({unchanged['second_after_save']:.2f} s after its save, against "
                        f"{unchanged['frozen_upload']:.1f} s)",
            "met": unchanged["ratio"] <= 0.05})
        print(f"{kind}: streaming {stream['ratio']:.2f} x max(write, upload) (after the save "
              f"{stream['old_ratio']:.2f} x); unchanged file durable in "
              f"{unchanged['ratio'] * 100:.1f} % of its first upload")
    return {
        "title": "Streaming upload: save start to durable, and unchanged files",
        "description": (__doc__ or "").strip().split("\n\n", 1)[1],
        "tables": [{
            "title": f"{size / MIB:.0f} MiB in {FILES} files, written and uploaded at "
                     f"{rate / MIB:.0f} MiB/s",
            "columns": ["destination", "upload", "write s", "save start to durable s",
                        "x max(write, upload)"],
            "rows": rows,
        }],
        "targets": targets,
        "notes": [
            "The upload time is the first way's measured upload (its durable time minus its "
            "write); the write time is the streaming run's own save (fsync included).",
            "With equal rates, a file can only go once written: the last file's upload "
            f"(1/{FILES} of the whole) is the least that follows the save's end.",
        ],
        "figures": figures,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--size", type=_parse_size, default=None, help="e.g. 2GiB, 256MiB")
    parser.add_argument("--rate", type=float, default=32.0, help="MiB/s, write and upload")
    parser.add_argument("--only", choices=("volume", "s3"), default=None)
    arguments = parser.parse_args(sys.argv[1:])
    main(quick=arguments.quick, size=arguments.size, rate_mib=arguments.rate,
         kinds=(arguments.only,) if arguments.only else ("volume", "s3"))
