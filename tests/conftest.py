from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

# Tests import the harness and the other helpers in tests/support/ as plain modules.
sys.path.insert(0, str(Path(__file__).parent / "support"))


from loopback_guard import install as install_loopback_guard

# Every connection beyond loopback is refused, here and in every process a test starts
# (tests/support/loopback_guard.py).
install_loopback_guard()

# A closed loopback port: bound, never listening, held for the whole session, so a connect
# is refused at once and nothing else can take it.
_CLOSED = socket.socket()
_CLOSED.bind(("127.0.0.1", 0))
CLOSED_URL = f"http://127.0.0.1:{_CLOSED.getsockname()[1]}"
# Every metadata service and cloud API a daemon could reach by default points at it, so a
# daemon or example started with the default `--source auto` probes nothing real (a test
# that wants a stand-in passes its own URL, and a flag wins over these).
METADATA_URL_SETTINGS = ("ESI_SIDECAR_METADATA_URL", "ESI_SIDECAR_AWS_IMDS_URL",
                         "ESI_SIDECAR_GCP_METADATA_URL", "ESI_SIDECAR_AZURE_METADATA_URL")
for _name in METADATA_URL_SETTINGS:
    os.environ[_name] = CLOSED_URL

# The machine's own cloud credentials never reach a test (or a daemon it starts): a test
# that wants credentials sets them itself, so one that must run without them cannot pick
# up a developer's ~/.aws and start a source that then talks to a stand-in it did not set up.
for _name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
              "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
    os.environ.pop(_name, None)
os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
os.environ["AWS_CONFIG_FILE"] = os.devnull

# CI sets this: there every tool and package is installed on purpose, so a skip means
# something went missing and must not pass for green. The one skip allowed names a
# kernel feature, not an install step.
FAIL_ON_SKIP = "SIDECAR_TESTS_FAIL_ON_SKIP"
ALLOWED_SKIPS = ("cannot boot systemd in namespaces here",)


# The tiers (STYLE.md, "Tests in tiers"): markers by folder and module, so the fast tier is
# `-m "not e2e and not slow and not frameworks and not integration"` (`make test-fast`).
TESTS = Path(__file__).parent
# A minute or more each, or a cluster, an image build or a release of a framework.
SLOW_MODULES = frozenset({
    "e2e/test_image.py",                             # builds the container image (podman)
    "e2e/test_slurm.py",                             # a real Slurm cluster
    "host/sources/test_source_slurm.py",
    "train/test_slurm_deadline.py",
    "integrations/test_integration_ray_drain.py",    # Ray clusters
    "integrations/test_integration_ray_nodes.py",
    "integrations/test_integration_verl_wheels.py",  # two verl releases
    "tools/test_simulate.py",                        # the simulator's reference workloads
    "tools/test_simulate_heavy.py",
    "tools/test_demo.py",                            # the whole demo, twice a trainer
    "host/test_api_fuzz.py",                         # schemathesis over every operation
})
# The middle tier: real servers and processes, seconds each. A real S3-protocol server or
# a volume the uploader commits to, a cloud's emulator or metadata service the daemon
# polls over HTTP, the daemon or the CLI as a process of its own, a venv per Python. Not in
# `make test-fast`, run by `make test` (docs/contributing.md).
INTEGRATION_FOLDERS = ("host/upload/", "host/sources/")
INTEGRATION_MODULES = frozenset({
    "host/test_daemon_volcengine.py",                # the SDK against the emulator
    "host/test_serve_process.py",                    # `esi-sidecar serve` as a process
    "host/test_hostile_connections.py",              # the daemon's connection cap, filled
    "host/test_hostile_posts.py",                    # floods of forged posts, a release waited on
    "host/test_reclaims_release.py",                 # a real release waited on, then restore
    "test_cli.py",                                   # the CLI as a process, against a daemon
    "train/test_client_stdlib_only.py",              # a bare venv per Python
})
# Under the parallel runner (`-n`, `--dist loadgroup`) the tests of one group run on one
# worker, one after another: a group shares something that two workers must not use at once.
SERIAL_GROUPS = {
    "e2e/test_image.py": "image",                    # one image build and its podman storage
    "e2e/test_slurm.py": "slurm",                    # munged, slurmctld and slurmd: the host's
    "host/sources/test_source_slurm.py": "slurm",    # hostname is the one node name
    "train/test_slurm_deadline.py": "slurm",
    "integrations/test_integration_ray_drain.py": "ray",  # Ray clusters: the CPU of 2 cores
    "integrations/test_integration_ray_nodes.py": "ray",
}


# tryfirst: before xdist's own hook, which reads xdist_group to keep a group on one worker.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            relative = Path(str(item.fspath)).relative_to(TESTS).as_posix()
        except ValueError:
            continue
        if relative.startswith("e2e/"):
            item.add_marker(pytest.mark.e2e)
        if relative in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        elif relative in INTEGRATION_MODULES or relative.startswith(INTEGRATION_FOLDERS):
            item.add_marker(pytest.mark.integration)
        if relative in SERIAL_GROUPS:
            item.add_marker(pytest.mark.xdist_group(SERIAL_GROUPS[relative]))
        elif "booted_systemd" in getattr(item, "fixturenames", ()):
            # systemd as PID 1 of new namespaces, but in the host's network namespace: each
            # starts the service on the default 127.0.0.1:8791, so two at once collide.
            item.add_marker(pytest.mark.xdist_group("systemd"))


@pytest.fixture
def unused_port() -> int:
    """A loopback port nobody listens on (bound, read, released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture(scope="module")
def s3() -> Any:
    """A real S3-protocol server (moto) on loopback, one per test module."""
    from upload_support import running_s3  # moto only for the tests that ask

    with running_s3() as server:
        yield server


@pytest.fixture
def bucket(s3: Any, request: pytest.FixtureRequest) -> Any:
    """A fresh bucket named after the test."""
    return s3.bucket("t-" + request.node.name.replace("_", "-").lower()[:50].strip("-"))


def _unexpected_skips(session: pytest.Session) -> list[Any]:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    return [
        report for report in skipped
        if not any(allowed in str(report.longrepr) for allowed in ALLOWED_SKIPS)
    ]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get(FAIL_ON_SKIP) and exitstatus == 0 and _unexpected_skips(session):
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    if os.environ.get(FAIL_ON_SKIP):
        skips = _unexpected_skips(terminalreporter._session)
        if skips:
            terminalreporter.write_line(
                f"{FAIL_ON_SKIP} is set: {len(skips)} skipped test(s) count as failures "
                "(see the skip reasons above)", red=True)
