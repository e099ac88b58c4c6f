"""Checkpoint upload: the daemon's uploader vs boto3's own ``upload_file``, same files.

Run: ``.venv/bin/python -m benchmarks.bench_upload`` (``main()`` returns the figures for the
common entry point, ``python -m benchmarks --only upload``). Needs boto3 and moto[server].

One checkpoint of three files (about 300 MB; 60 MB with ``--quick``) is committed with
``atomic_checkpoint`` and uploaded to moto's S3 server, started as a separate process on
127.0.0.1 so the server does not share the client's interpreter. Two ways, interleaved,
each to a fresh prefix, with the same ``TransferConfig`` (64 MiB parts, 8 at once):

- ``boto3``: ``client.upload_file(path, bucket, key, Config=config)`` for each file, one
  after the other: what a plain upload script does;
- ``uploader``: ``sidecar.host.upload.Uploader`` from ``start()`` until the checkpoint is
  durable: the folder scan, the remote-manifest check, every file through boto3's transfer
  manager (files and parts in parallel), HeadObject of every object, the manifest last.

The ratio is uploader throughput over boto3 throughput, medians of the repeats, measured
in the same run. Loopback and an in-memory server make the network free, so the figure is
the uploader's own overhead (and its gain from sending files in parallel), not what a real
link to TOS or S3 would give: there, both wait on the same bandwidth.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

FILES_MB = (120, 100, 80)  # about 300 MB in three files
QUICK_FILES_MB = (24, 20, 16)
REPEATS = 3
QUICK_REPEATS = 1
MIB = 1 << 20


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_moto() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).read()
            return process, endpoint
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("moto's server did not start") from None
            time.sleep(0.1)


def _empty(client: Any, bucket: str) -> None:
    """Delete every object, so the in-memory server does not grow across repeats."""
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})


def _measure(files_mb: tuple[int, ...], repeats: int) -> dict[str, Any]:
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    from sidecar.checkpoint.folders import atomic_checkpoint
    from sidecar.host.upload.location import S3Location
    from sidecar.host.upload.storage import make_client, transfer_config
    from sidecar.host.upload.storage_config import StorageConfig
    from sidecar.host.upload.uploader import Uploader, UploaderConfig

    server, endpoint = _start_moto()
    try:
        storage = StorageConfig(endpoint=endpoint, access_key="bench", secret_key="bench")
        client = make_client(storage)
        bucket = "bench-upload"
        client.create_bucket(Bucket=bucket)
        config = transfer_config(storage)
        with tempfile.TemporaryDirectory(prefix="bench-upload-") as workdir:
            root = Path(workdir)
            save = atomic_checkpoint(root, 1)
            with save as folder:
                for index, megabytes in enumerate(files_mb):
                    (folder / f"shard_{index}.bin").write_bytes(os.urandom(megabytes * MIB))
            assert save.info is not None
            info = save.info
            total = info.total_bytes

            def plain(prefix: str) -> None:
                for entry in info.files:
                    client.upload_file(str(info.path / entry.path), bucket,
                                       f"{prefix}/{info.name}/{entry.path}", Config=config)

            def uploader(prefix: str) -> None:
                up = Uploader(UploaderConfig(root, S3Location(bucket, prefix), storage,
                                             scan_interval_seconds=0.05))
                up.start()
                try:
                    deadline = time.monotonic() + 600
                    while up.tracker.last_durable() is None:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"upload did not finish: {up.tracker.body()}")
                        time.sleep(0.005)
                finally:
                    up.stop()

            variants = {"boto3 upload_file": plain, "uploader": uploader}
            seconds: dict[str, list[float]] = {name: [] for name in variants}
            for repeat in range(repeats):
                for name, action in variants.items():
                    prefix = f"r{repeat}-{name.split()[0]}"
                    started = time.perf_counter()
                    action(prefix)
                    seconds[name].append(time.perf_counter() - started)
                    _empty(client, bucket)
    finally:
        server.terminate()
        server.wait(10)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    throughput = {name: total / MIB / value for name, value in medians.items()}
    return {
        "bytes": total,
        "files": len(files_mb),
        "median_seconds": medians,
        "all_seconds": seconds,
        "throughput_mib_s": throughput,
        "ratio": throughput["uploader"] / throughput["boto3 upload_file"],
        "part_size": storage.part_size,
        "concurrency": storage.concurrency,
    }


def main(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark, print a summary, and return the figures (and a report)."""
    files_mb = QUICK_FILES_MB if quick else FILES_MB
    repeats = QUICK_REPEATS if quick else REPEATS
    figures = _measure(files_mb, repeats)
    ratio = figures["ratio"]
    seconds, rate = figures["median_seconds"], figures["throughput_mib_s"]
    print(f"upload of {figures['bytes'] / MIB:.0f} MiB in {figures['files']} files to moto on "
          f"loopback, median of {repeats}: boto3 {rate['boto3 upload_file']:.0f} MiB/s, "
          f"uploader {rate['uploader']:.0f} MiB/s, ratio {ratio:.2f}")
    rows = [[name, f"{seconds[name]:.2f}", f"{rate[name]:.0f}",
             ", ".join(f"{value:.2f}" for value in figures["all_seconds"][name])]
            for name in seconds]
    return {
        "title": "Checkpoint upload: the uploader vs boto3 `upload_file`",
        "description": (__doc__ or "").strip().split("\n\n", 1)[1],
        "tables": [{
            "title": f"{figures['bytes'] / MIB:.0f} MiB in {figures['files']} files, "
                     f"{figures['part_size'] // MIB} MiB parts, {figures['concurrency']} at once",
            "columns": ["way", "median s", "MiB/s", "each run, s"],
            "rows": rows,
        }],
        "targets": [{
            "target": "uploader throughput >= 0.9 x boto3 upload_file (same files, same "
                      "TransferConfig)",
            "measured": f"{ratio:.2f} x ({rate['uploader']:.0f} vs "
                        f"{rate['boto3 upload_file']:.0f} MiB/s)",
            "met": ratio >= 0.9,
        }],
        "notes": [
            "The uploader's time includes what a plain upload skips: the folder scan, the "
            "remote manifest check, a HeadObject per object and the manifest PUT.",
            "moto keeps objects in memory and runs in Python: absolute MiB/s are this "
            "server's, not a real link's.",
        ],
        "figures": figures,
    }


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:])
