"""Shared pieces of the container image test (no tests here): podman on a storage of its
own, and a Debian base image with Python made by debootstrap from Debian's archive,
cached on this machine.

The base is the slow part (about a minute): its root filesystem is kept as a tarball in
CACHE_DIR, named by a hash of what went into it (suite, variant, packages, architecture,
recipe), so a later run imports it in seconds. The tarball is written under a temporary
name and renamed when complete: a run killed half-way leaves nothing that is ever used.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

__all__ = ["BASE_PACKAGES", "CACHE_DIR", "BaseTarball", "Podman", "base_rootfs_tarball",
           "debian_mirror", "output_tail", "remove_tree", "run_bounded"]

SUITE = "bookworm"
VARIANT = "minbase"
# python3-venv brings ensurepip (install.sh makes the venv with it); ca-certificates is
# the bundle the daemon verifies the ECS OpenAPI's certificate with. Nothing else: no pip
# of Debian's, no compilers.
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
# Bump when the steps in _make_rootfs change what the tarball holds.
RECIPE = 1
CACHE_DIR = Path(os.environ.get("ESI_SIDECAR_TEST_CACHE", "/var/cache/esi-sidecar-tests"))
APT_SOURCES = Path("/etc/apt")


def output_tail(text: Optional[str | bytes], lines: int = 25) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").rstrip().splitlines()[-lines:])


def run_bounded(command: Sequence[str], *, timeout: float, what: str,
                **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run ``command`` with a time limit; fail with its output's tail when it fails or
    runs past the limit."""
    try:
        result = subprocess.run(list(command), capture_output=True, text=True,
                                timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{what}: still running after {timeout:.0f} s:\n"
                             f"{output_tail(exc.stderr) or output_tail(exc.stdout)}") from None
    if result.returncode != 0:
        raise AssertionError(f"{what} failed (exit {result.returncode}):\n"
                             f"{output_tail(result.stderr) or output_tail(result.stdout)}")
    return result


def mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve())
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix + "/"):
            found.append(point)
    return found


def remove_tree(path: Path) -> None:
    """rm -rf, but never through a mount point (a bind-mounted /dev, say)."""
    if not path.exists() and not path.is_symlink():
        return
    mounted = mounts_under(path)
    if mounted:
        raise AssertionError(f"not removing {path}: mounts under it: {mounted}")
    shutil.rmtree(path)


# ---------------------------------------------------------------------- podman


@dataclass
class Podman:
    """podman with its own image store (``--root``), so the images and containers the
    test makes are all removed with it and none of the machine's own is touched."""

    binary: str
    root: Path

    def command(self, *args: str) -> list[str]:
        return [self.binary, "--root", str(self.root / "storage"),
                "--runroot", str(self.root / "run"), "--events-backend", "none", *args]

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run_bounded(self.command(*args), timeout=timeout, what=f"podman {args[0]}")

    def inspect(self, image: str) -> dict[str, Any]:
        found: list[dict[str, Any]] = json.loads(self("image", "inspect", image).stdout)
        return found[0]

    def remove_everything(self) -> None:
        for args in (("rm", "--all", "--force"), ("rmi", "--all", "--force")):
            subprocess.run(self.command(*args), capture_output=True, timeout=120)
        run_dir = self.root / "run"
        if mounts_under(run_dir) or mounts_under(self.root / "storage"):
            subprocess.run(self.command("unmount", "--all", "--force"), capture_output=True,
                           timeout=60)
        remove_tree(self.root)


# ---------------------------------------------------------------------- the Debian base


def _deb822_entries(text: str) -> Iterator[dict[str, list[str]]]:
    for stanza in text.split("\n\n"):
        fields: dict[str, list[str]] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[0].isspace():
                continue
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.split()
        if fields:
            yield fields


def _one_line_entries(text: str) -> Iterator[dict[str, list[str]]]:
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if len(words) >= 4 and words[0] == "deb":
            if words[1].startswith("["):  # options: deb [signed-by=...] URI SUITE ...
                while words and not words[1].endswith("]"):
                    del words[1]
                del words[1]
            if len(words) >= 4:
                yield {"types": ["deb"], "uris": [words[1]], "suites": [words[2]],
                       "components": words[3:]}


def debian_mirror(suite: str = SUITE, sources: Path = APT_SOURCES) -> Optional[str]:
    """The archive this machine's apt uses for ``suite`` (main), for debootstrap; None
    when apt names none (debootstrap then uses its default). ESI_SIDECAR_TEST_DEBIAN_MIRROR
    wins."""
    if os.environ.get("ESI_SIDECAR_TEST_DEBIAN_MIRROR"):
        return os.environ["ESI_SIDECAR_TEST_DEBIAN_MIRROR"]
    files = [sources / "sources.list", *sorted((sources / "sources.list.d").glob("*"))]
    for path in files:
        try:
            text = path.read_text()
        except OSError:
            continue
        entries = _deb822_entries(text) if path.suffix == ".sources" else (
            _one_line_entries(text))
        for entry in entries:
            if ("deb" in entry.get("types", []) and suite in entry.get("suites", [])
                    and "main" in entry.get("components", []) and entry.get("uris")):
                return entry["uris"][0]
    return None


def base_key() -> str:
    """What the base is made of, hashed: a change of any of it makes a new base."""
    recipe = {"suite": SUITE, "variant": VARIANT, "packages": sorted(BASE_PACKAGES),
              "architecture": platform.machine(), "recipe": RECIPE}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()


@contextmanager
def _locked(directory: Path, timeout: float) -> Iterator[None]:
    """One maker of the base at a time on this machine (others wait, then find it)."""
    with open(directory / ".lock", "w") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{directory}/.lock held for over {timeout:.0f} s"
                                         ) from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _make_rootfs(debootstrap: str, target: Path, mirror: Optional[str], timeout: float) -> None:
    # In a mount namespace of its own: the /proc, /sys (and, inside a container, the bind
    # mounts of /dev) that debootstrap makes in the target end with it, even when killed.
    command = ["unshare", "--mount", "--propagation", "private", "--",
               debootstrap, f"--variant={VARIANT}", f"--include={','.join(BASE_PACKAGES)}",
               SUITE, str(target)]
    if mirror:
        command.append(mirror)
    run_bounded(command, timeout=timeout, what="debootstrap")
    # What `apt-get clean` and the usual `rm -rf /var/lib/apt/lists/*` leave (about 95 MB).
    for leftovers in ("var/cache/apt", "var/lib/apt/lists"):
        for path in (target / leftovers).glob("*"):
            if path.is_dir() and not path.is_symlink():
                remove_tree(path)
            else:
                path.unlink()


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@dataclass
class BaseTarball:
    path: Path
    key: str
    cached: bool  # found on disk, not made by this call
    seconds: float  # the time this call spent getting it


def base_rootfs_tarball(debootstrap: str, mirror: Optional[str], *,
                        cache_dir: Path = CACHE_DIR, timeout: float = 600) -> BaseTarball:
    """The base's root filesystem as a tarball: from the cache, or made (debootstrap,
    trimmed, tarred) and put there atomically."""
    started = time.monotonic()
    key = base_key()
    final = cache_dir / f"debian-{SUITE}-python-{key[:16]}.tar"
    if final.is_file():
        return BaseTarball(final, key, True, time.monotonic() - started)
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _locked(cache_dir, timeout + 60):
        if final.is_file():  # made by another run while this one waited
            return BaseTarball(final, key, True, time.monotonic() - started)
        # Under the lock nothing else is being made here: anything half-made is a leftover.
        for leftover in cache_dir.glob(".making-*"):
            remove_tree(leftover)
        work = cache_dir / f".making-{key[:16]}-{os.getpid()}"
        work.mkdir()
        try:
            rootfs = work / "rootfs"
            _make_rootfs(debootstrap, rootfs, mirror, timeout)
            partial = work / "base.tar"
            run_bounded(["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-cf",
                         str(partial), "."], timeout=300, what="tar of the base")
            _fsync(partial)
            os.replace(partial, final)
            _fsync(cache_dir)
        finally:
            remove_tree(work)
    return BaseTarball(final, key, False, time.monotonic() - started)
