"""README.md's "Try the daemon against the emulator" (issue 39, item 10): the path starts
with the server install, not ``make test`` (the whole test suite's dependencies)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def emulator_blocks() -> list[str]:
    section = README.read_text().split("## Try the daemon against the emulator", 1)[1]
    section = section.split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, re.S)


def test_the_emulator_path_starts_with_the_server_install_only() -> None:
    first = emulator_blocks()[0]
    commands = [line.split("#", 1)[0].strip() for line in first.splitlines()]
    commands = [command for command in commands if command]
    assert not any(command.startswith("make") for command in commands), first
    installs = [part for command in commands for part in command.split("&&")
                if "pip install" in part]
    (install,) = installs
    assert shlex.split(install)[-1] == ".[server]", install  # no test, dev or upload extras
    assert any(command.startswith("esi-sidecar emulate") for command in commands)
