"""The daemon's container image: built from the Dockerfile, inspected, and its entrypoint
run as the image's user against the emulator.

podman builds the image with ``--isolation=chroot`` (its runtime cannot create cgroups on
these machines) on a Debian base with Python made by debootstrap from Debian's archive,
so no registry is needed; the base is cached on the machine (tests/support/image_support.py).
``podman run`` cannot start a container here either (crun cannot set rlimits or
cgroups), so the image's filesystem is exported (``podman create`` + ``podman export``)
and its ENTRYPOINT, ENV, USER and HEALTHCHECK are taken from the image's own metadata and
run under ``chroot --userspec``, in the host's network namespace: the daemon listens on
127.0.0.1 and polls the emulator on loopback. What this cannot show: the container's own
namespaces, cgroup limits, seccomp, a published port (docs/deploy.md says so).

Both variants are built: the default (``[server]``) and ``--build-arg UPLOAD=1``
(``[server,upload]``, whose uploader copies a checkpoint to a folder here).

About 1 min with the base cached, 2 min without; run alone:
``.venv/bin/python -m pytest tests/e2e/test_image.py``. Needs root, podman, debootstrap.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import pytest
import tomllib
from daemon_harness import fetch_json, get_json, wait_for
from image_support import (
    BaseTarball,
    Podman,
    base_rootfs_tarball,
    debian_mirror,
    output_tail,
    remove_tree,
    run_bounded,
)

import sidecar
from sidecar.checkpoint.folders import atomic_checkpoint, latest_valid
from sidecar.tools.emulator import Emulator

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PODMAN = shutil.which("podman")
DEBOOTSTRAP = shutil.which("debootstrap") or shutil.which("debootstrap", path="/usr/sbin")
CHROOT = shutil.which("chroot") or shutil.which("chroot", path="/usr/sbin")
# The build reaches the package index through this machine's CA bundle (where HTTPS goes
# through a proxy with its own CA, the base's bundle would not do).
HOST_CA_BUNDLE = Path(os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt")
IMAGE_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
# What the venv may add to the base, at most (measured: [server] about 55 MB with pip and
# setuptools, [upload] about 25 MB more). The all-services volcengine-python-sdk (630 MB)
# or a compiler toolchain would not fit.
MAX_ADDED_MB = {"server": 100, "upload": 160}
UPLOAD_DISTRIBUTIONS = {"boto3", "botocore", "s3transfer"}
ACCESS_KEY = "AKLTimagetest0001"
SECRET_KEY = "image-test-secret-key"
INSTANCE = "i-image0001"
SCHEDULED = "esi-image0001"


def _missing() -> Optional[str]:
    if os.environ.get("ESI_SIDECAR_TEST_OFFLINE") == "1":
        return ("ESI_SIDECAR_TEST_OFFLINE=1: the build needs the package index and "
                "debootstrap Debian's archive")
    if os.geteuid() != 0:
        return "needs root (debootstrap, chroot and podman's chroot isolation)"
    if PODMAN is None:
        return "podman is not installed (Debian: apt-get install podman)"
    if DEBOOTSTRAP is None:
        return "debootstrap is not installed (Debian: apt-get install debootstrap)"
    if CHROOT is None or shutil.which("unshare") is None:
        return "chroot (coreutils) and unshare (util-linux) are needed"
    return None


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(requirements: list[str]) -> set[str]:
    """``["boto3>=1.34", "moto[server]>=5"]`` -> ``{"boto3", "moto"}``."""
    return {normalized(re.split(r"[\[<>=!~;\s]", line, maxsplit=1)[0]) for line in requirements}


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def podman() -> Iterator[Podman]:
    reason = _missing()
    if reason:
        pytest.skip(reason)
    assert PODMAN is not None
    tool = Podman(PODMAN, Path(tempfile.mkdtemp(prefix="esi-image-podman-")))
    try:
        yield tool
    finally:
        tool.remove_everything()


@dataclass
class Base:
    image: str
    size: int
    tarball: BaseTarball
    import_seconds: float


@pytest.fixture(scope="module")
def base(podman: Podman) -> Base:
    assert DEBOOTSTRAP is not None
    tarball = base_rootfs_tarball(DEBOOTSTRAP, debian_mirror())
    image = f"localhost/esi-sidecar-test-base:{tarball.key[:12]}"
    started = time.monotonic()
    podman("import", str(tarball.path), image, timeout=300)
    return Base(image, podman.inspect(image)["Size"], tarball, time.monotonic() - started)


@dataclass
class Built:
    variant: str
    image: str
    inspect: dict[str, Any]
    rootfs: Path
    build_seconds: float

    @property
    def config(self) -> dict[str, Any]:
        config: dict[str, Any] = self.inspect["Config"]
        return config

    @property
    def environ(self) -> dict[str, str]:
        return dict(item.split("=", 1) for item in self.config["Env"])

    @property
    def venv(self) -> Path:
        return self.rootfs / "opt" / "esi-sidecar"

    def distributions(self) -> dict[str, str]:
        """Every distribution in the image's venv: normalized name -> version."""
        found = {}
        for metadata in self.venv.glob("lib/python3*/site-packages/*.dist-info/METADATA"):
            fields = dict(re.findall(r"^(Name|Version): (.+)$", metadata.read_text(), re.M))
            found[normalized(fields["Name"])] = fields["Version"].strip()
        return found


@pytest.fixture(scope="module", params=["server", "upload"])
def built(request: pytest.FixtureRequest, podman: Podman, base: Base) -> Iterator[Built]:
    """The image as `docker build` makes it (with `--build-arg UPLOAD=1` for "upload"),
    and its filesystem exported to a folder."""
    variant: str = request.param
    image = f"localhost/esi-sidecar-test:{variant}"
    mount = (["--volume", f"{HOST_CA_BUNDLE}:{IMAGE_CA_BUNDLE}:ro"]
             if HOST_CA_BUNDLE.is_file() else [])
    started = time.monotonic()
    # --format docker: the OCI format has no HEALTHCHECK (podman drops it with a warning).
    podman("build", "--format", "docker", "--isolation", "chroot", "--pull=never", *mount,
           "--build-arg", f"PYTHON_IMAGE={base.image}",
           "--build-arg", f"UPLOAD={'1' if variant == 'upload' else ''}",
           "--tag", image, "--file", str(REPO / "Dockerfile"), str(REPO), timeout=600)
    build_seconds = time.monotonic() - started
    work = Path(tempfile.mkdtemp(prefix="esi-image-rootfs-"))
    try:
        container = podman("create", "--no-healthcheck", image).stdout.strip()
        podman("export", "--output", str(work / "image.tar"), container, timeout=300)
        podman("rm", container)
        rootfs = work / "rootfs"
        rootfs.mkdir()
        run_bounded(["tar", "--numeric-owner", "-xpf", str(work / "image.tar"), "-C",
                     str(rootfs)], timeout=300, what="tar -x of the exported image")
        (work / "image.tar").unlink()
        yield Built(variant, image, podman.inspect(image), rootfs, build_seconds)
    finally:
        remove_tree(work)
        subprocess.run(podman.command("rmi", "--force", image), capture_output=True,
                       timeout=120)


@pytest.fixture
def emulator() -> Iterator[Emulator]:
    with Emulator(access_key=ACCESS_KEY, secret_key=SECRET_KEY, region="cn-beijing",
                  instance_id=INSTANCE, scheduled_instance_id=SCHEDULED) as emu:
        yield emu


# ---------------------------------------------------------------------- running the image


def in_image(built: Built, *command: str) -> list[str]:
    """``command`` as the image's user, with the image's filesystem as its root."""
    return [str(CHROOT), f"--userspec={built.config['User']}", str(built.rootfs), *command]


def image_environ(built: Built, **overrides: str) -> dict[str, str]:
    # The image's ENV, plus HOME as docker sets it for a user without a passwd entry.
    return {**built.environ, "HOME": "/", **overrides}


@contextmanager
def running_entrypoint(built: Built, log: Path, **overrides: str
                       ) -> Iterator[subprocess.Popen[bytes]]:
    command = in_image(built, *built.config["Entrypoint"], *(built.config.get("Cmd") or []))
    with log.open("wb") as output:
        process = subprocess.Popen(command, env=image_environ(built, **overrides),
                                   stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def healthcheck(built: Built, **overrides: str) -> subprocess.CompletedProcess[str]:
    """The image's HEALTHCHECK command, as the runtime runs it (exec form, the image's
    user and environment)."""
    test = (built.inspect.get("Healthcheck") or {}).get("Test") or ["none"]
    assert test[0] == "CMD", test
    return subprocess.run(in_image(built, *test[1:]), env=image_environ(built, **overrides),
                          capture_output=True, text=True, timeout=30)


def process_ids(pid: int) -> dict[str, list[str]]:
    status = Path(f"/proc/{pid}/status").read_text()
    return {name: values.split() for name, values in re.findall(
        r"^(Uid|Gid|Groups):\s*(.*)$", status, re.M)}


def make_checkpoint(root: Path, step: int) -> None:
    with atomic_checkpoint(root, step) as folder:
        (folder / "model.bin").write_bytes(os.urandom(256 * 1024))


def chown_tree(path: Path, uid: int, gid: int) -> None:
    for item in [path, *path.rglob("*")]:
        os.chown(item, uid, gid, follow_symlinks=False)


# ---------------------------------------------------------------------- tests


def test_image_metadata(built: Built) -> None:
    config = built.config
    assert config["User"] == "10001:10001"  # not root
    assert config["Entrypoint"] == ["esi-sidecar", "serve"] and not config.get("Cmd")
    assert config["ExposedPorts"] == {"8791/tcp": {}}
    assert config["StopSignal"] == "SIGTERM"
    assert "/var/lib/esi-sidecar" in config["Volumes"]
    assert config.get("WorkingDir") in (None, "", "/")  # chroot starts in /
    environ = built.environ
    assert environ["PATH"].split(":")[0] == "/opt/esi-sidecar/bin"
    assert environ["ESI_SIDECAR_LISTEN"] == "0.0.0.0:8791"
    assert environ["ESI_SIDECAR_STATE_FILE"] == "/var/lib/esi-sidecar/state.json"
    health = built.inspect.get("Healthcheck")
    assert health, "no HEALTHCHECK in the image (the OCI format drops it: --format docker)"
    assert health["Test"] == ["CMD", "python", "/opt/esi-sidecar/healthcheck.py"]
    assert (health["Interval"], health["Timeout"], health["StartPeriod"], health["Retries"]) == (
        30 * 10**9, 5 * 10**9, 90 * 10**9, 3)
    labels = config["Labels"]
    assert labels["org.opencontainers.image.title"] == PYPROJECT["project"]["name"]
    assert labels["org.opencontainers.image.licenses"] == PYPROJECT["project"]["license"]
    assert labels["org.opencontainers.image.description"]
    assert built.inspect["Os"] == "linux"
    state = (built.rootfs / "var/lib/esi-sidecar").stat()
    assert (state.st_uid, state.st_gid, state.st_mode & 0o777) == (10001, 10001, 0o700)


def test_image_holds_the_install_and_nothing_else(built: Built) -> None:
    installed = built.distributions()
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert installed.get("esi-sidecar") == sidecar.__version__, sorted(installed)
    wanted = requirement_names(extras["server"])
    if built.variant == "upload":
        wanted |= requirement_names(extras["upload"])
    assert wanted <= installed.keys(), sorted(wanted - installed.keys())
    # Nothing of the development extras, nor the all-services SDK.
    unwanted = set().union(*(requirement_names(extras[name]) for name in
                             ("test", "frameworks", "simulate", "dev")))
    unwanted |= {"volcengine-python-sdk"}
    if built.variant == "server":
        unwanted |= UPLOAD_DISTRIBUTIONS
    assert not unwanted & installed.keys(), sorted(unwanted & installed.keys())
    # No compilers or build tools on any PATH folder; the builder's sources stayed there.
    tools = {"gcc", "cc", "c++", "g++", "clang", "make", "ld"}
    for folder in built.environ["PATH"].split(":"):
        present = {tool for tool in tools if (built.rootfs / folder.lstrip("/") / tool).exists()}
        assert not present, f"{folder}: {sorted(present)}"
    assert not (built.rootfs / "src").exists()
    site_packages = next(built.venv.glob("lib/python3*/site-packages"))
    assert not (site_packages / "tests").exists()
    # The venv runs on the final stage's own Python, the base's (COPY --from=builder
    # relies on both stages having it at the same path).
    python = os.readlink(built.venv / "bin" / "python3")
    assert (built.rootfs / python.lstrip("/")).is_file(), python


def test_image_size_against_the_base(built: Built, base: Base,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    size = built.inspect["Size"]
    added_mb = (size - base.size) / 1e6
    line = (f"image {built.variant}: {size / 1e6:.0f} MB, base {base.size / 1e6:.0f} MB "
            f"(+{added_mb:.0f} MB); built in {built.build_seconds:.1f} s; base "
            f"{'from the cache' if base.tarball.cached else 'debootstrapped'} in "
            f"{base.tarball.seconds:.1f} s, imported in {base.import_seconds:.1f} s")
    with capsys.disabled():
        print(f"\n{line}")
    assert 0 < added_mb <= MAX_ADDED_MB[built.variant], line


def test_the_images_default_address_needs_a_token(built: Built, tmp_path: Path) -> None:
    """ESI_SIDECAR_LISTEN=0.0.0.0:8791 (the image's own) is beyond loopback: without
    ESI_SIDECAR_TOKEN the entrypoint stops at once with one line, binding nothing."""
    assert built.environ["ESI_SIDECAR_LISTEN"] == "0.0.0.0:8791"
    command = in_image(built, *built.config["Entrypoint"], *(built.config.get("Cmd") or []))
    environ = image_environ(built, ESI_SIDECAR_SOURCE="static",
                            ESI_SIDECAR_EXPIRES_AT="2030-01-01T00:00:00Z")
    environ.pop("ESI_SIDECAR_TOKEN", None)
    result = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "--listen 0.0.0.0:8791 is beyond loopback" in lines[0], lines


def test_entrypoint_serves_as_the_images_user(
    built: Built, emulator: Emulator, unused_port: int, tmp_path: Path
) -> None:
    """The entrypoint with the image's ENV as its user: /healthz, /v1/expiry, the
    HEALTHCHECK command and `esi-sidecar status` in the image, a clean stop on SIGTERM
    with the state file written; with [upload], a checkpoint copied to a folder."""
    release = emulator.set_release_in(3600)
    url = f"http://127.0.0.1:{unused_port}"
    # 127.0.0.1 instead of the image's 0.0.0.0: this runs in the host's network namespace.
    settings = {
        "ESI_SIDECAR_LISTEN": f"127.0.0.1:{unused_port}",
        "ESI_SIDECAR_SOURCE": "volcengine-esi",  # auto would probe link-local addresses
        "ESI_SIDECAR_API_ENDPOINT": emulator.url,
        "ESI_SIDECAR_METADATA_URL": emulator.url,
        "ESI_SIDECAR_POLL_INTERVAL": "1",
        "VOLCENGINE_ACCESS_KEY": ACCESS_KEY,
        "VOLCENGINE_SECRET_KEY": SECRET_KEY,
    }
    state_dir = built.rootfs / "var/lib/esi-sidecar"
    local, volume = state_dir / "checkpoints", state_dir / "volume"
    if built.variant == "upload":
        for folder in (local, volume):
            folder.mkdir()
        make_checkpoint(local, 100)
        chown_tree(local, 10001, 10001)
        chown_tree(volume, 10001, 10001)
        settings.update({
            "ESI_SIDECAR_UPLOAD_FROM": "/" + str(local.relative_to(built.rootfs)),
            "ESI_SIDECAR_UPLOAD_TO": "file:///" + str(volume.relative_to(built.rootfs)),
            "ESI_SIDECAR_UPLOAD_SCAN_INTERVAL": "0.2",
        })
    log = tmp_path / "daemon.log"

    def said() -> str:
        return output_tail(log.read_text(errors="replace"), 40)

    with running_entrypoint(built, log, **settings) as daemon:
        def healthy_or_gone() -> bool:
            answer = fetch_json(url + "/healthz")
            return daemon.poll() is not None or (answer is not None and answer[0] == 200)

        try:
            wait_for(healthy_or_gone, timeout=60, interval=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{said()}") from None
        assert daemon.poll() is None, f"the entrypoint exited ({daemon.returncode}):\n{said()}"
        ids = process_ids(daemon.pid)
        assert ids["Uid"] == ["10001"] * 4 and ids["Gid"] == ["10001"] * 4, ids
        assert "0" not in ids["Groups"], ids

        status, expiry = get_json(url + "/v1/expiry")
        assert status == 200, expiry
        assert expiry["source"] == "volcengine-esi" and expiry["kind"] == "scheduled-release"
        assert (expiry["instance_id"], expiry["scheduled_instance_id"]) == (INSTANCE, SCHEDULED)
        assert expiry["expires_at_unix"] == pytest.approx(
            datetime.fromisoformat(release).timestamp(), abs=1)
        assert 3500 < expiry["remaining_seconds"] <= 3600 and expiry["stale"] is False

        check = healthcheck(built, ESI_SIDECAR_LISTEN=settings["ESI_SIDECAR_LISTEN"])
        assert check.returncode == 0, check.stdout + check.stderr
        shown = subprocess.run(in_image(built, "esi-sidecar", "status", "--url", url),
                               env=image_environ(built), capture_output=True, text=True,
                               timeout=30)
        assert shown.returncode == 0 and "releases in" in shown.stdout, (
            shown.stdout + shown.stderr)

        if built.variant == "upload":
            def durable_step() -> Any:
                return get_json(url + "/v1/uploads")[1].get("last_durable_step")

            try:
                wait_for(lambda: durable_step() == 100, timeout=60, interval=0.1)
            except AssertionError as exc:
                raise AssertionError(f"{exc}: /v1/uploads says "
                                     f"{get_json(url + '/v1/uploads')[1]}\n{said()}") from None
            copied = latest_valid(volume, verify_checksums=True)
            assert copied is not None and copied.step == 100

        started = time.monotonic()
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=15)
        assert time.monotonic() - started < 10, said()
    assert "state flushed" in log.read_text(), said()
    state = state_dir / "state.json"
    assert state.stat().st_uid == 10001  # written by the image's user
    assert "volcengine-esi" in json.loads(state.read_text())["sources"]
    assert SECRET_KEY not in log.read_text()

    down = healthcheck(built, ESI_SIDECAR_LISTEN=settings["ESI_SIDECAR_LISTEN"])
    assert down.returncode == 1 and "unhealthy" in down.stderr, down.stdout + down.stderr
