"""Restore: ``esi-sidecar restore`` against ``cp -r`` (volume) and boto3's ``download_file``
(S3 on moto), the same checkpoint, in the same run (issue 40, item 1).

Run: ``.venv/bin/python -m benchmarks.bench_restore`` (``python -m benchmarks --only
restore``). Needs boto3 and moto[server] for the S3 half.

One checkpoint of 8 files of 128 MiB (1 GiB; 8 x 16 MiB with ``--quick``) is saved with
``atomic_checkpoint`` and committed by the daemon's own destinations: onto a folder that
stands for the volume (``VolumeDestination``) and into moto's S3 server, started as a
separate process on 127.0.0.1 (``S3Destination``). Then, each repeat, in alternating
order, with the page cache dropped before every timed run (``sync; echo 3 >
/proc/sys/vm/drop_caches``, as root) and a ``sync`` after it (untimed, so no run pays
for the one before):

- volume: ``cp -r VOLUME/step_... DIR`` against ``restore_newest("file://VOLUME", DIR)``
  (what ``esi-sidecar restore --from file://VOLUME`` runs, in-process: the listing, the
  copy with every file hashed as it is written, the fsyncs, the commit, ``latest``);
- S3: ``client.download_file(bucket, key, path)`` for each of the 8 objects, one after
  the other, with boto3's default transfer settings (8 MiB parts, 10 threads), against
  ``restore_newest("s3://...", DIR)`` with the default settings (8 ranged GETs of 8 MiB
  at once, each file verified in the same pass). Both use the project's client
  (``make_client``), so only the way of downloading differs.

``cp -r`` and ``download_file`` neither verify nor fsync; the restore does both. The
``sync`` after ``cp -r`` is timed apart and shown, for the same durability.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

FILES = 8
FILE_MIB = 128
QUICK_FILE_MIB = 16
REPEATS = 5
QUICK_REPEATS = 2
MIB = 1 << 20
VOLUME_TARGET = 1.25
S3_TARGET = 1.2
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    """moto's S3 server in its own process on loopback; its endpoint once it answers."""
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


def can_drop_caches() -> bool:
    try:
        with open(DROP_CACHES, "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


def cold(drop: bool) -> None:
    os.sync()
    if drop:
        with open(DROP_CACHES, "w") as handle:
            handle.write("3\n")


def timed(action: Callable[[], Any]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _load() -> float:
    return os.getloadavg()[0]


def _measure(file_mib: int, repeats: int) -> dict[str, Any]:
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    from sidecar.checkpoint.folders import atomic_checkpoint
    from sidecar.checkpoint.manifest import MANIFEST_NAME
    from sidecar.host.upload.fetch import restore_newest
    from sidecar.host.upload.location import S3Location
    from sidecar.host.upload.storage import make_client
    from sidecar.host.upload.storage_config import StorageConfig
    from sidecar.host.upload.transfer import S3Destination
    from sidecar.host.upload.volume import VolumeDestination

    drop = can_drop_caches()
    seconds: dict[str, list[float]] = {name: [] for name in (
        "cp -r", "sync after cp -r", "restore (volume)", "boto3 download_file",
        "restore (S3)")}
    loads: list[float] = []
    server, endpoint = start_moto()
    try:
        storage = StorageConfig(endpoint=endpoint, access_key="bench", secret_key="bench")
        client = make_client(storage)
        client.create_bucket(Bucket="bench-restore")
        location = S3Location("bench-restore", "run")
        with tempfile.TemporaryDirectory(prefix="bench-restore-", dir="/var/tmp") as workdir:
            work = Path(workdir)
            save = atomic_checkpoint(work / "local", 1)
            with save as folder:
                for index in range(FILES):
                    with open(folder / f"shard_{index}.bin", "wb") as handle:
                        for _ in range(file_mib // 16 or 1):
                            handle.write(os.urandom(min(16, file_mib) * MIB))
            assert save.info is not None
            info = save.info
            manifest = (info.path / MANIFEST_NAME).read_bytes()
            volume = work / "volume"
            volume.mkdir()
            for destination in (VolumeDestination(volume),
                                S3Destination(storage, location, make_client)):
                destination.prepare(time.time())
                destination.upload(info, manifest, on_progress=lambda count: None,
                                   should_stop=lambda: None, before_manifest=lambda: None)
            shutil.rmtree(work / "local")
            keys = [location.key(info.name, entry.path) for entry in info.files]
            storage_options = {"endpoint": endpoint, "access_key": "bench",
                               "secret_key": "bench"}
            out = work / "out"

            def fresh() -> Path:
                shutil.rmtree(out, ignore_errors=True)
                cold(drop)
                return out

            def copy() -> None:
                subprocess.run(["cp", "-r", str(volume / info.name), str(out)], check=True)

            def from_volume() -> None:
                restore_newest(volume.as_uri(), out, {})

            def download() -> None:
                out.mkdir()
                for key in keys:
                    client.download_file(location.bucket, key, str(out / key.rsplit("/")[-1]))

            def from_s3() -> None:
                restore_newest(location.url, out, storage_options)

            pairs = {"volume": (("cp -r", copy), ("restore (volume)", from_volume)),
                     "S3": (("boto3 download_file", download), ("restore (S3)", from_s3))}
            for repeat in range(repeats):
                loads.append(_load())
                for pair in pairs.values():
                    for name, action in pair if repeat % 2 == 0 else reversed(pair):
                        fresh()
                        seconds[name].append(timed(action))
                        if name == "cp -r":
                            seconds["sync after cp -r"].append(timed(os.sync))
                shutil.rmtree(out, ignore_errors=True)
                print(f"  repeat {repeat + 1}/{repeats}: " + ", ".join(
                    f"{name} {values[-1]:.2f} s" for name, values in seconds.items()),
                    flush=True)
    finally:
        server.terminate()
        server.wait(10)
    ratios = {
        "volume": [r / c for r, c in zip(seconds["restore (volume)"], seconds["cp -r"])],
        "volume_synced": [r / (c + s) for r, c, s in zip(
            seconds["restore (volume)"], seconds["cp -r"], seconds["sync after cp -r"])],
        "S3": [r / d for r, d in zip(seconds["restore (S3)"], seconds["boto3 download_file"])],
    }
    return {
        "bytes": info.total_bytes,
        "files": FILES,
        "cold": drop,
        "seconds": seconds,
        "median_seconds": {name: statistics.median(values) for name, values in seconds.items()},
        "ratios": ratios,
        "median_ratio": {name: statistics.median(values) for name, values in ratios.items()},
        "loads": loads,
        "cores": len(os.sched_getaffinity(0)),
    }


def main(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark, print a summary, and return the figures (and a report)."""
    figures = _measure(QUICK_FILE_MIB if quick else FILE_MIB,
                       QUICK_REPEATS if quick else REPEATS)
    median, ratio = figures["median_seconds"], figures["median_ratio"]
    size = figures["bytes"] / MIB
    caches = "cold caches" if figures["cold"] else "warm caches (drop_caches not writable)"
    print(f"restore of {size:.0f} MiB in {figures['files']} files, {caches}: volume "
          f"{ratio['volume']:.2f} x cp -r, S3 {ratio['S3']:.2f} x download_file")
    rows = [[name, f"{median[name]:.2f}", f"{size / median[name]:.0f}",
             ", ".join(f"{value:.2f}" for value in values)]
            for name, values in figures["seconds"].items()]
    ratio_rows = [[name, f"{ratio[name]:.2f}",
                   ", ".join(f"{value:.2f}" for value in values)]
                  for name, values in figures["ratios"].items()]
    loads = ", ".join(f"{value:.1f}" for value in figures["loads"])
    return {
        "title": "Restore: from a volume vs `cp -r`, from S3 vs boto3 `download_file`",
        "description": (__doc__ or "").strip().split("\n\n", 1)[1],
        "tables": [
            {"title": f"{size:.0f} MiB in {figures['files']} files, {caches}, "
                      f"{len(figures['loads'])} repeats",
             "columns": ["way", "median s", "MiB/s", "each run, s"], "rows": rows},
            {"title": "Ratios, restore over baseline, each repeat (median first)",
             "columns": ["pair", "median", "each repeat"], "rows": ratio_rows},
        ],
        "targets": [
            {"target": f"restore from a volume <= {VOLUME_TARGET} x `cp -r`, cold caches",
             "measured": f"{ratio['volume']:.2f} x ({median['restore (volume)']:.2f} vs "
                         f"{median['cp -r']:.2f} s)",
             "met": ratio["volume"] <= VOLUME_TARGET},
            {"target": f"restore from S3 (moto) <= {S3_TARGET} x boto3 `download_file`",
             "measured": f"{ratio['S3']:.2f} x ({median['restore (S3)']:.2f} vs "
                         f"{median['boto3 download_file']:.2f} s)",
             "met": ratio["S3"] <= S3_TARGET},
        ],
        "notes": [
            f"Load average (1 min) at each repeat: {loads}, on {figures['cores']} usable "
            "cores shared with other work: the medians and the same-run ratios are the "
            "figures to read, the absolute times are this machine's at that moment.",
            "`volume_synced`: the restore over `cp -r` plus the `sync` that makes the copy "
            "as durable as the restore (which fsyncs every file and folder).",
            "sha256 is sequential within a file, so one file is hashed at one core's "
            "speed at most; files (and ranges, when there are fewer files than threads) "
            "run in parallel.",
        ],
        "figures": figures,
    }


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:])
