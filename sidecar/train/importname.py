"""Says when another distribution shares the ``sidecar`` import name with esi-sidecar.

The unrelated ``sidecar`` distribution on PyPI (a JupyterLab widget) also installs a
top-level ``sidecar`` package. In one environment the later install overwrites the other's
``sidecar/__init__.py``, and uninstalling either deletes it (issue 26). ``sidecar/__init__``
stats the widget's module and imports this only when it is there; then the ``*.dist-info``
records beside the package name the distribution whose ``__init__.py`` is on disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

__all__ = ["Sharer", "describe_clash", "sharing_distributions", "warn_if_shared"]

OUR_DISTRIBUTION = "esi-sidecar"
# The widget's module in sidecar/ (every release has it; this project never will).
WIDGET_FILES = ("sidecar.py",)
KNOWN = {"sidecar": "a JupyterLab widget"}
INIT_RECORD = "sidecar/__init__.py"


class Sharer:
    """Another installed distribution whose RECORD lists ``sidecar/__init__.py``. (A plain
    class: a dataclass costs more to define than the whole check at a fine import.)"""

    __slots__ = ("name", "owns_init", "version")

    def __init__(self, name: str, version: str, owns_init: bool) -> None:
        self.name = name
        self.version = version
        self.owns_init = owns_init  # its recorded hash is the __init__.py on disk

    def __str__(self) -> str:
        what = KNOWN.get(_normalized(self.name))
        return f"{self.name} {self.version}" + (f" ({what})" if what else "")


def _normalized(name: str) -> str:
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def _file_hash(path: Path) -> str:
    import base64
    import hashlib  # loads OpenSSL: only on the slow path, never at a fine import

    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _name_and_version(dist_info: Path) -> tuple[str, str]:
    fields: dict[str, str] = {}
    try:
        with open(dist_info / "METADATA", encoding="utf-8", errors="replace") as metadata:
            for line in metadata:
                if not line.strip():
                    break  # the headers end at the first blank line
                key, _, value = line.partition(":")
                fields.setdefault(key.strip().lower(), value.strip())
    except OSError:
        pass
    stem_name, _, stem_version = dist_info.name.removesuffix(".dist-info").partition("-")
    return fields.get("name") or stem_name, fields.get("version") or stem_version


def sharing_distributions(package_dir: Path) -> list[Sharer]:
    """The distributions beside ``package_dir`` (the ``sidecar`` folder) other than
    esi-sidecar that installed a ``sidecar/__init__.py`` there."""
    init = package_dir / "__init__.py"
    try:
        on_disk: Optional[str] = _file_hash(init)
    except OSError:
        on_disk = None
    found = []
    try:
        entries = sorted(os.scandir(package_dir.parent), key=lambda entry: entry.name)
    except OSError:
        return []
    for entry in entries:
        if not entry.name.endswith(".dist-info"):
            continue
        try:
            record = Path(entry.path, "RECORD").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for line in record.splitlines():
            path, _, rest = line.partition(",")
            if path != INIT_RECORD:
                continue
            name, version = _name_and_version(Path(entry.path))
            if _normalized(name) != OUR_DISTRIBUTION:
                found.append(Sharer(name, version, rest.partition(",")[0] == on_disk))
            break
    return found


def describe_clash(package_dir: Path, *, thorough: bool = False) -> Optional[str]:
    """One line naming the distribution that shares the import name, or None. Without
    ``thorough`` the records are read only when one of the widget's files is there."""
    folder = os.fspath(package_dir)
    if not thorough and not any(os.path.exists(os.path.join(folder, name))
                                for name in WIDGET_FILES):
        return None
    sharers = sharing_distributions(package_dir)
    owner = next((sharer for sharer in sharers if sharer.owns_init), None)
    if owner is not None:
        return (f"`import sidecar` loads {owner}, not esi-sidecar: both install a top-level "
                f"'sidecar' package into {package_dir.parent}; run `pip uninstall "
                f"{owner.name} esi-sidecar` and reinstall esi-sidecar, or keep them in "
                "separate environments")
    if sharers:
        return (f"{sharers[0]} also installs a top-level 'sidecar' package into "
                f"{package_dir.parent}; uninstalling either deletes the other's "
                "sidecar/__init__.py: keep them in separate environments")
    return None


def warn_if_shared(package_dir: Path) -> None:
    """At ``import sidecar``: a RuntimeWarning when another distribution shares it."""
    message = describe_clash(package_dir)
    if message is not None:
        import warnings

        warnings.warn(f"esi-sidecar: {message}", RuntimeWarning, stacklevel=3)
