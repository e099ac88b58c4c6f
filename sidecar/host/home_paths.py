"""The folders under a home that the service must read to run an ``esi-sidecar``.

The unit runs as a ``DynamicUser=`` with ``ProtectHome=yes``, which hides ``/home``,
``/root`` and ``/run/user``. An ``esi-sidecar`` whose interpreter lives there (pyenv,
conda, a venv or a ``pipx install --global`` made from them) could never start. Rather than
refuse it, the unit written for it turns the homes into an empty read-only tmpfs
(``ProtectHome=tmpfs``) and binds these folders alone into it, read-only
(``BindReadOnlyPaths=``): the interpreter's prefixes, never a whole home (issue 39, item 2).

Standard library only; the interpreter is run once (as ``-I``) to name its prefixes.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess

__all__ = ["HOME_PREFIXES", "HomePathError", "folders_to_read", "in_home", "interpreter"]

HOME_PREFIXES = ("/home/", "/root/", "/run/user/")
_PREFIXES = ("import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, "
             "sys.exec_prefix, sys.base_exec_prefix]))")
# Other users' read and search bits: the dynamic user is neither the owner nor the group.
_OTHERS_READ = stat.S_IROTH | stat.S_IXOTH


class HomePathError(Exception):
    """A folder the service would need cannot be made readable to it."""


def in_home(path: str) -> bool:
    return path.startswith(HOME_PREFIXES)


def interpreter(executable: str) -> str:
    """The #! interpreter of a console script ('' for a binary or an unreadable file)."""
    try:
        with open(executable, "rb") as script:
            first = script.readline(512)
    except OSError:
        return ""
    return first[2:].decode(errors="replace").split()[0] if first.startswith(b"#!/") else ""


def _prefixes(python: str) -> list[str]:
    try:
        result = subprocess.run([python, "-I", "-c", _PREFIXES], capture_output=True,
                                text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HomePathError(f"cannot run {python} to find its folders: {exc}") from exc
    if result.returncode != 0:
        said = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise HomePathError(f"cannot run {python} to find its folders: {said}")
    return [str(path) for path in json.loads(result.stdout)]


def _outermost(paths: set[str]) -> list[str]:
    """The paths not inside another of them, sorted."""
    kept: list[str] = []
    for path in sorted(paths):
        if not any(path == outer or path.startswith(outer + "/") for outer in kept):
            kept.append(path)
    return kept


def folders_to_read(executable: str) -> list[str]:
    """The folders under a home that running ``executable`` reads: its interpreter's
    prefixes (the venv and the Python it was made from), or the executable's folder when
    it is no Python script; each as written and with links resolved. [] when nothing it
    runs is in a home. A folder other users cannot read is a HomePathError."""
    python = interpreter(executable)
    touched = [executable, os.path.realpath(executable)]
    if python:
        touched += [python, os.path.realpath(python)]
    if not any(in_home(path) for path in touched):
        return []
    folders = _prefixes(python) if python else []
    if not any(executable.startswith(folder.rstrip("/") + "/") for folder in folders):
        folders.append(os.path.dirname(executable))
    wanted = {form for folder in folders
              for form in (os.path.normpath(folder), os.path.realpath(folder))}
    found = _outermost({folder for folder in wanted if in_home(folder)})
    for folder in found:
        try:
            mode = os.stat(folder).st_mode
        except OSError as exc:
            raise HomePathError(f"{folder}: {exc.strerror}") from exc
        if mode & _OTHERS_READ != _OTHERS_READ:
            raise HomePathError(
                f"{folder} (mode {stat.S_IMODE(mode):o}) is not readable by other users, so "
                "the service's dynamic user cannot run from it: chmod o+rx it, or install "
                "with a system interpreter (/usr/bin/python3)")
    return found
