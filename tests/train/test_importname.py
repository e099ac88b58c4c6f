"""The ``sidecar`` import name shared with the unrelated ``sidecar`` distribution (a
JupyterLab widget, 0.8.1 on PyPI): a site folder made here holds a copy of this package,
the widget's files and their ``*.dist-info`` records, as pip leaves them when both are
installed in one environment, in either order."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from sidecar.train.importname import describe_clash, sharing_distributions

PACKAGE = Path(__file__).resolve().parents[2] / "sidecar"
WIDGET_INIT = "from ._version import __version__\nfrom .sidecar import Sidecar\n"
WIDGET_FILES = {"sidecar.py": "class Sidecar:\n    pass\n",
                "_version.py": '__version__ = "0.8.1"\n'}


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(
        b"=").decode()


def _dist_info(site: Path, name: str, version: str, files: dict[str, bytes]) -> None:
    folder = site / f"{name.replace('-', '_')}-{version}.dist-info"
    folder.mkdir()
    (folder / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nA description.\n")
    lines = [f"{path},{_hash(data)},{len(data)}" for path, data in files.items()]
    (folder / "RECORD").write_text("\n".join([*lines, f"{folder.name}/RECORD,,", ""]))


def _site(tmp_path: Path, *, widget: str | None) -> Path:
    """esi-sidecar installed; ``widget`` 'before' (ours overwrote its __init__.py) or
    'after' (its __init__.py overwrote ours), or None (ours alone)."""
    site = tmp_path / "site"
    shutil.copytree(PACKAGE, site / "sidecar", ignore=shutil.ignore_patterns("__pycache__"))
    ours = (site / "sidecar" / "__init__.py").read_bytes()
    _dist_info(site, "esi-sidecar", "0.1.0", {"sidecar/__init__.py": ours})
    if widget is not None:
        for name, text in WIDGET_FILES.items():
            (site / "sidecar" / name).write_text(text)
        if widget == "after":
            (site / "sidecar" / "__init__.py").write_text(WIDGET_INIT)
        files = {f"sidecar/{name}": text.encode() for name, text in WIDGET_FILES.items()}
        _dist_info(site, "sidecar", "0.8.1",
                   {"sidecar/__init__.py": WIDGET_INIT.encode(), **files})
    return site


def _python(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(site),
           "PYTHONWARNINGS": "default"}
    return subprocess.run([sys.executable, *args], cwd=site.parent, env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_alone_nothing_is_said(tmp_path: Path) -> None:
    site = _site(tmp_path, widget=None)
    assert sharing_distributions(site / "sidecar") == []
    assert describe_clash(site / "sidecar", thorough=True) is None
    result = _python(site, "-W", "error", "-c",
                     "import sys, sidecar; print(sidecar.__file__); "
                     "print('sidecar.train.importname' in sys.modules)")
    assert result.returncode == 0, result.stderr
    location, loaded = result.stdout.split()
    assert Path(location).is_relative_to(site)  # the copy, not this checkout
    assert loaded == "False"  # the fine path imports nothing to check


def test_import_sidecar_names_the_widget_whose_files_share_the_folder(tmp_path: Path) -> None:
    site = _site(tmp_path, widget="before")
    [sharer] = sharing_distributions(site / "sidecar")
    assert (sharer.name, sharer.version, sharer.owns_init) == ("sidecar", "0.8.1", False)
    result = _python(site, "-c", "import sidecar; print(sidecar.CheckpointGuard.__name__)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "CheckpointGuard"
    assert "RuntimeWarning: esi-sidecar: sidecar 0.8.1 (a JupyterLab widget) also installs" \
        " a top-level 'sidecar' package" in result.stderr, result.stderr
    assert "uninstalling either deletes the other's sidecar/__init__.py" in result.stderr


def test_the_cli_names_the_widget_when_import_sidecar_is_the_widget(tmp_path: Path) -> None:
    site = _site(tmp_path, widget="after")
    [sharer] = sharing_distributions(site / "sidecar")
    assert sharer.owns_init
    result = _python(site, "-m", "sidecar.cli", "env", "--url", "http://127.0.0.1:9",
                     "--timeout", "0.5")
    assert result.returncode == 3, result.stderr  # unreachable daemon, as before
    first = result.stderr.splitlines()[0]
    assert first.startswith("esi-sidecar: warning: `import sidecar` loads sidecar 0.8.1 "
                            "(a JupyterLab widget), not esi-sidecar"), first
    assert "pip uninstall sidecar esi-sidecar" in first
