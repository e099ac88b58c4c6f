"""The checkpoint waits for the job (issue 40, item 2): with the follower's copy in place,
how long ``esi-sidecar run --restore-from file://VOLUME --to DIR -- CMD`` takes to reach
the command, against the command started directly. Target: within 1 s of its start.

    python -m benchmarks.bench_resume [--repeats N] [--mib 1024]

A checkpoint of 8 files (``--mib`` in all) is saved on a volume folder and put in place
locally by the daemon's follower (the real ``Follower``, not a copy by hand); then each
repeat starts ``esi-sidecar run`` and the command prints the instant it starts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sidecar.checkpoint.folders import atomic_checkpoint
from sidecar.host.upload.follow_sources import VolumeSource
from sidecar.host.upload.follower import Follower

STAMP = [sys.executable, "-S", "-c", "import time; print(time.time())"]


def _started(command: list[str]) -> float:
    before = time.time()
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1]) - before


def run(repeats: int = 10, mib: int = 1024) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as temp:
        volume, local = Path(temp, "volume"), Path(temp, "local")
        volume.mkdir()
        local.mkdir()
        with atomic_checkpoint(volume, 100, checksum=True) as folder:
            for index in range(8):
                (folder / f"shard-{index}.bin").write_bytes(os.urandom(mib * (1 << 20) // 8))
        follower = Follower(local, VolumeSource(volume), interval_seconds=0.05)
        started = time.monotonic()
        follower.start()
        while not follower.brought and time.monotonic() - started < 600:
            time.sleep(0.05)
        follower.stop()
        brought = follower.brought[0]
        exe = str(Path(sys.executable).with_name("esi-sidecar"))
        launcher = [exe, "run", "--restore-from", volume.as_uri(), "--to", str(local), "--",
                    *STAMP]
        direct = [_started(STAMP) for _ in range(repeats)]
        through = [_started(launcher) for _ in range(repeats)]
    return {"mib": mib, "follower_seconds": brought.finished_unix - brought.started_unix,
            "direct_median": statistics.median(direct), "run_median": statistics.median(through),
            "run_max": max(through)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--mib", type=int, default=1024)
    args = parser.parse_args()
    result = run(args.repeats, args.mib)
    print(f"checkpoint of {result['mib']} MiB in 8 files put in place by the follower in "
          f"{result['follower_seconds']:.2f} s")
    print(f"command started directly: median {result['direct_median']:.3f} s")
    print(f"through esi-sidecar run (checkpoint in place): median {result['run_median']:.3f} s,"
          f" max {result['run_max']:.3f} s; target within 1 s: "
          f"{'met' if result['run_max'] <= 1.0 else 'NOT met'}")


if __name__ == "__main__":
    main()
