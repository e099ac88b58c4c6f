"""The release files: one version everywhere, and the sdist and wheel a user gets.

The build runs as ``python -m build`` does it, without needing that package: setuptools'
backend makes the sdist from a copy of the checkout, then the wheel from the unpacked
sdist (so a file the sdist forgets fails the wheel). ``twine check`` runs when twine is
installed (the test extra has it). The wheel is installed with ``--no-deps`` into a fresh
venv with no extras, which imports ``sidecar`` and runs ``esi-sidecar --version``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import venv
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

import sidecar

REPO = Path(__file__).resolve().parents[2]
VERSION = sidecar.__version__
# Where a version is written for people to type: image tags, pins, install.sh --version.
_RELEASE = r"\d+\.\d+\.\d+(?:(?:a|b|rc|\.post|\.dev)\d+)?"  # PEP 440; "-upload" is a tag's
VERSION_MENTIONS = re.compile(
    rf"esi-sidecar(?:\[[a-z,]+\])?(?::|==)(?P<tag>{_RELEASE})"
    rf"|install\.sh --version (?P<flag>{_RELEASE})"
)
# The sdist is the release archive install.sh runs from (docs/deploy.md).
SDIST_FILES = (
    "install.sh", "LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "MANIFEST.in",
    "Dockerfile",
    "deploy/esi-sidecar.service", "deploy/esi-sidecar.env.example",
    "deploy/kubernetes/daemonset.yaml", "deploy/grafana/esi-sidecar.json",
    "deploy/prometheus/esi-sidecar.rules.yml", "deploy/prometheus/esi-sidecar.rules.test.yml",
    "deploy/healthcheck.py",
    "docs/deploy.md", "docs/architecture.md", "examples/README.md", "examples/plain_pytorch.py",
    "sidecar/__init__.py", "sidecar/py.typed",
    "sidecar/host/deploy_files/esi-sidecar.service",
    "sidecar/host/deploy_files/esi-sidecar.env.example",
)
# A pip user gets the unit and the env example as package data, same bytes as deploy/.
PACKAGE_DATA = {
    "sidecar/host/deploy_files/esi-sidecar.service": "deploy/esi-sidecar.service",
    "sidecar/host/deploy_files/esi-sidecar.env.example": "deploy/esi-sidecar.env.example",
}


# ---------------------------------------------------------------------- one version


def test_the_version_is_read_from_the_package() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "sidecar.__version__"
    }


def test_esi_sidecar_version_prints_it() -> None:
    result = subprocess.run([sys.executable, "-m", "sidecar.cli", "--version"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"esi-sidecar {VERSION}"


def _written_versions(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return [m.group("tag") or m.group("flag") for m in VERSION_MENTIONS.finditer(text)]


def test_every_file_that_names_the_version_names_this_one() -> None:
    files = [REPO / "Dockerfile", REPO / "README.md", REPO / "deploy/kubernetes/daemonset.yaml",
             REPO / "install.sh", *sorted((REPO / "docs").glob("*.md"))]
    wrong = {str(path.relative_to(REPO)): found for path in files
             if (found := [v for v in _written_versions(path) if v != VERSION])}
    assert wrong == {}, f"sidecar/__init__.py says {VERSION}"
    # The Dockerfile's build argument labels the image; its default is this version.
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(rf"^ARG VERSION={re.escape(VERSION)}$", dockerfile, re.MULTILINE)
    assert 'org.opencontainers.image.version="${VERSION}"' in dockerfile


def test_the_manifest_runs_the_image_of_this_version() -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML parses the manifest")
    documents = yaml.safe_load_all((REPO / "deploy/kubernetes/daemonset.yaml").read_text())
    images = [container["image"] for doc in documents if doc and doc["kind"] == "DaemonSet"
              for container in doc["spec"]["template"]["spec"]["containers"]]
    assert images and all(image.rsplit(":", 1)[1] == VERSION for image in images), images


def test_the_changelog_starts_with_this_release() -> None:
    headings = re.findall(r"^## (\S+)", (REPO / "CHANGELOG.md").read_text(), re.MULTILINE)
    headings = [heading for heading in headings if heading != "Unreleased"]  # not yet out
    assert headings and headings[0] == VERSION, headings


def test_the_license_is_the_apache_license() -> None:
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"


# ---------------------------------------------------------------------- the archives


@dataclass(frozen=True)
class Release:
    sdist: Path
    wheel: Path


def _checkout_copy(target: Path) -> None:
    """The files git knows (tracked, and new ones it does not ignore): what a clean
    clone holds, without this checkout's caches and build leftovers."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=False,
    )
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.decode().strip()}")
    for name in sorted(set(listed.stdout.decode().split("\0")) - {""}):
        source = REPO / name
        if not os.path.lexists(source):
            continue  # deleted, not yet committed
        destination = target / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, destination, follow_symlinks=False)


def _backend(call: str, cwd: Path, out: Path) -> Path:
    code = f"from setuptools import build_meta; print(build_meta.{call}({str(out)!r}))"
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out / result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    root = tmp_path_factory.mktemp("release")
    checkout = root / "checkout"
    _checkout_copy(checkout)
    dist = root / "dist"
    sdist = _backend("build_sdist", checkout, dist)
    with tarfile.open(sdist) as archive:
        archive.extractall(root / "unpacked", filter="data")
    unpacked = root / "unpacked" / sdist.name.removesuffix(".tar.gz")
    yield Release(sdist, _backend("build_wheel", unpacked, dist))


def _sdist_names(release: Release) -> set[str]:
    with tarfile.open(release.sdist) as archive:
        prefix = release.sdist.name.removesuffix(".tar.gz") + "/"
        return {m.name.removeprefix(prefix) for m in archive.getmembers() if m.isfile()}


def test_the_sdist_is_the_release_archive(release: Release) -> None:
    assert release.sdist.name == f"esi_sidecar-{VERSION}.tar.gz"
    names = _sdist_names(release)
    missing = [name for name in SDIST_FILES if name not in names]
    assert missing == []
    with tarfile.open(release.sdist) as archive:
        script = archive.getmember(release.sdist.name.removesuffix(".tar.gz") + "/install.sh")
        assert script.mode & 0o111, "install.sh must stay executable"
        for packaged in PACKAGE_DATA:
            member = archive.getmember(f"esi_sidecar-{VERSION}/{packaged}")
            assert member.isfile(), f"{packaged}: a plain file in the sdist, not a link"


def test_the_wheel_carries_the_types_the_unit_and_the_env_example(release: Release) -> None:
    assert release.wheel.name == f"esi_sidecar-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(release.wheel) as archive:
        names = set(archive.namelist())
        assert "sidecar/py.typed" in names
        for packaged, source in PACKAGE_DATA.items():
            assert archive.read(packaged) == (REPO / source).read_bytes(), packaged
        metadata = archive.read(f"esi_sidecar-{VERSION}.dist-info/METADATA").decode()
        assert f"esi_sidecar-{VERSION}.dist-info/licenses/LICENSE" in names
    assert f"\nVersion: {VERSION}\n" in metadata
    assert "\nLicense-Expression: Apache-2.0\n" in metadata
    assert "\nClassifier: Typing :: Typed\n" in metadata
    assert "\nProject-URL: Changelog, CHANGELOG.md\n" in metadata
    # No dependency without an extra: the training side's install is the standard library.
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert requires and all("extra ==" in line for line in requires), requires


def test_the_wheel_leaves_the_document_generators_to_the_repository(release: Release) -> None:
    # docs/simulation.md's writer is a repository script (issue 38, item 4); the wheel keeps
    # the simulator, its table, CSV and plot.
    with zipfile.ZipFile(release.wheel) as archive:
        names = set(archive.namelist())
    assert "sidecar/tools/simulate/table.py" in names
    assert not [name for name in names if name.startswith("tools/")
                or name.rsplit("/", 1)[-1] in ("simulation_report.py", "simulation_heavy.py",
                                               "report.py", "report_heavy.py")]


@pytest.mark.skipif(importlib.util.find_spec("twine") is None,
                    reason="twine is not installed (pip install -e '.[test]' adds it)")
def test_twine_check_passes(release: Release) -> None:
    result = subprocess.run([sys.executable, "-m", "twine", "check", "--strict",
                             str(release.sdist), str(release.wheel)],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_wheel_installs_alone_and_runs(release: Release, tmp_path: Path) -> None:
    """No extras, no dependencies: `import sidecar` and `esi-sidecar --version` work, and
    the packaged unit is found through importlib.resources."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, symlinks=True)
    python = env_dir / "bin" / "python"
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
             "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
         "--no-deps", "--no-index", str(release.wheel)],
        capture_output=True, text=True, timeout=300, env=clean, check=False)
    assert install.returncode == 0, install.stdout + install.stderr
    probe = (
        "import importlib.resources, sidecar, sys; "
        "unit = importlib.resources.files('sidecar.host') / 'deploy_files/esi-sidecar.service';"
        "print(sidecar.__version__, sidecar.__file__, unit.read_text().count('ExecStart='))"
    )
    result = subprocess.run([str(python), "-c", probe], cwd=tmp_path, env=clean,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    version, location, exec_lines = result.stdout.split()
    assert version == VERSION and exec_lines == "1"
    assert Path(location).is_relative_to(env_dir), location  # the wheel's copy, not ours
    cli = subprocess.run([str(env_dir / "bin" / "esi-sidecar"), "--version"], cwd=tmp_path,
                         env=clean, capture_output=True, text=True, timeout=60, check=False)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.strip() == f"esi-sidecar {VERSION}"
    # The service from pip (issue 26, item 2): the wheel's own unit, ExecStart naming it.
    shown = subprocess.run([str(env_dir / "bin" / "esi-sidecar"), "install", "--print",
                            "--root", str(tmp_path / "root")], cwd=tmp_path, env=clean,
                           capture_output=True, text=True, timeout=60, check=False)
    assert shown.returncode == 0, shown.stderr
    assert f"\nExecStart={(env_dir / 'bin' / 'esi-sidecar').resolve()} serve\n" in shown.stdout
