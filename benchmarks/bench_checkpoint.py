"""What does atomic_checkpoint cost over a plain torch.save of the same state?

Run: ``.venv/bin/python -m benchmarks.bench_checkpoint`` (``main()`` returns the figures for
the common entry point). Needs torch. For each size (about 200 MB and 500 MB of float32
tensors), and for a few repeats, four ways of saving the same state dict are timed,
interleaved, each after ``os.sync()`` so none pays for another's dirty pages:

- ``plain``: ``torch.save(state, path)``, what most training loops do: it returns once the
  bytes are in the page cache, not on disk;
- ``plain+fsync``: the same, then fsync of the file and its folder: the least any
  crash-safe save must do;
- ``atomic``: ``with atomic_checkpoint(root, step, keep_last=1) as d: torch.save(state, d /
  "model.pt")``: fsync, manifest, rename, pointer, retention;
- ``atomic+sha256``: the same with ``checksum=True`` (one more read of every byte).

Ratios are medians over the repeats, measured in the same run. ``atomic / plain+fsync`` is
the wrapper's own overhead; ``atomic / plain`` also counts the price of durability, which
depends on the disk. Set ``BENCH_CHECKPOINT_DIR`` to measure on the storage you train on
(the default is the temp folder; a tmpfs there makes fsync free and the figures moot).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from sidecar.checkpoint.durable import fsync_path
from sidecar.checkpoint.folders import atomic_checkpoint

SIZES_MB = (200, 500)
REPEATS = 5
TENSORS_PER_STATE = 8


def _filesystem(path: Path) -> str:
    """The file-system type holding ``path`` (from /proc/mounts), or 'unknown'."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if (
                    len(fields) >= 3
                    and str(path).startswith(fields[1])
                    and len(fields[1]) > len(best)
                ):
                    best, kind = fields[1], fields[2]
    except OSError:
        pass
    return kind


def _timed(action: Callable[[], None]) -> float:
    os.sync()
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _measure(workdir: Path, megabytes: int) -> dict[str, Any]:
    import torch

    count = megabytes * (1 << 20) // 4 // TENSORS_PER_STATE
    state = {f"layer{i}.weight": torch.rand(count) for i in range(TENSORS_PER_STATE)}
    plain_path = workdir / "plain.pt"
    root = workdir / f"atomic-{megabytes}"
    step = 0

    def plain() -> None:
        torch.save(state, plain_path)

    def plain_fsync() -> None:
        torch.save(state, plain_path)
        fsync_path(plain_path)
        fsync_path(workdir)

    def atomic(checksum: bool) -> Callable[[], None]:
        def save() -> None:
            nonlocal step
            step += 1
            with atomic_checkpoint(root, step, keep_last=1, checksum=checksum) as folder:
                torch.save(state, folder / "model.pt")

        return save

    variants = {
        "plain": plain,
        "plain+fsync": plain_fsync,
        "atomic": atomic(False),
        "atomic+sha256": atomic(True),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(REPEATS):
        for name, action in variants.items():
            times[name].append(_timed(action))
    plain_path.unlink()
    medians = {name: statistics.median(values) for name, values in times.items()}
    bytes_saved = sum(t.numel() * t.element_size() for t in state.values())
    return {
        "bytes": bytes_saved,
        "median_seconds": medians,
        "all_seconds": times,
        "ratio_atomic_vs_plain": medians["atomic"] / medians["plain"],
        "ratio_atomic_sha256_vs_plain": medians["atomic+sha256"] / medians["plain"],
        "ratio_atomic_vs_plain_fsync": medians["atomic"] / medians["plain+fsync"],
        "ratio_atomic_sha256_vs_plain_fsync": medians["atomic+sha256"] / medians["plain+fsync"],
    }


def main() -> dict[str, Any]:
    """Run the benchmark, print a table, and return the figures."""
    import torch

    base = os.environ.get("BENCH_CHECKPOINT_DIR") or tempfile.gettempdir()
    results: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "repeats": REPEATS,
        "sizes": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-", dir=base) as workdir:
        folder = Path(workdir)
        results["directory"] = str(folder)
        results["filesystem"] = _filesystem(folder.resolve())
        for megabytes in SIZES_MB:
            results["sizes"][f"{megabytes}MB"] = _measure(folder, megabytes)

    print(
        f"atomic_checkpoint vs torch.save: median of {REPEATS}, "
        f"{results['filesystem']} at {base}, torch {results['torch']}"
    )
    header = (
        f"{'size':>6} {'plain s':>8} {'+fsync s':>9} {'atomic s':>9} {'+sha256 s':>10} "
        f"{'atomic/plain':>13} {'sha/plain':>10} {'atomic/fsync':>13} {'sha/fsync':>10}"
    )
    print(header)
    for label, figures in results["sizes"].items():
        m = figures["median_seconds"]
        print(
            f"{label:>6} {m['plain']:8.3f} {m['plain+fsync']:9.3f} {m['atomic']:9.3f} "
            f"{m['atomic+sha256']:10.3f} {figures['ratio_atomic_vs_plain']:13.2f} "
            f"{figures['ratio_atomic_sha256_vs_plain']:10.2f} "
            f"{figures['ratio_atomic_vs_plain_fsync']:13.2f} "
            f"{figures['ratio_atomic_sha256_vs_plain_fsync']:10.2f}"
        )
    return results


if __name__ == "__main__":
    main()
