"""docs/deploy.md's drop-in for the uploader, as written (issue 39, item 7).

The unit's sandbox (``ProtectSystem=strict``) leaves every folder read-only but its state
directory: the drop-in must name the checkpoint folder and a ``file://`` destination in
``ReadWritePaths=``, and pass ``systemd-analyze verify`` beside the unit.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.host.install_service import ENV_FILE, unit_text
from sidecar.host.upload.location import parse_destination

REPO = Path(__file__).resolve().parents[2]
DEPLOY_DOC = REPO / "docs" / "deploy.md"
SCRIPT = Path(sys.executable).parent / "esi-sidecar"  # this venv's console script


def documented_block() -> str:
    """The shell block of "The uploader under the unit's sandbox"."""
    text = DEPLOY_DOC.read_text()
    section = text.split("### The uploader under the unit's sandbox", 1)[1]
    match = re.search(r"```sh\n(.*?)```", section, re.S)
    assert match is not None, "docs/deploy.md: no shell block in the uploader's section"
    return match.group(1)


def env_lines(block: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in block.splitlines()
                if line.startswith("ESI_SIDECAR_"))


def dropin_text(block: str) -> str:
    match = re.search(r"<<'CONF'\n(.*?)^CONF$", block, re.S | re.M)
    assert match is not None, "docs/deploy.md: no drop-in written with <<'CONF'"
    return match.group(1)


def directive(text: str, key: str) -> list[str]:
    return [value for line in text.splitlines() if line.startswith(f"{key}=")
            for value in line.split("=", 1)[1].split()]


def test_the_dropin_makes_the_checkpoint_folder_and_the_destination_writable() -> None:
    block = documented_block()
    env = env_lines(block)
    destination = parse_destination(env["ESI_SIDECAR_UPLOAD_TO"])
    assert isinstance(destination, Path), "the documented example is a file:// destination"
    dropin = dropin_text(block)
    writable = [Path(path) for path in directive(dropin, "ReadWritePaths")]
    assert Path(env["ESI_SIDECAR_UPLOAD_FROM"]) in writable
    assert destination in writable, f"{destination} stays read-only under ProtectSystem=strict"
    # The upload's parts in flight (8 x 64 MiB by default) fit under the drop-in's cap.
    (memory,) = directive(dropin, "MemoryMax")
    assert memory.endswith("G") and int(memory[:-1]) >= 1


def test_the_dropin_passes_systemd_analyze_verify_with_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    if not SCRIPT.exists():
        pytest.skip(f"{SCRIPT} is not installed")
    env_file = tmp_path / "esi-sidecar.env"  # verify checks that EnvironmentFile= exists
    env_file.write_text("")
    unit = tmp_path / "esi-sidecar.service"
    unit.write_text(unit_text(str(SCRIPT)).replace(f"EnvironmentFile={ENV_FILE}",
                                                   f"EnvironmentFile={env_file}"))
    (tmp_path / "esi-sidecar.service.d").mkdir()
    (tmp_path / "esi-sidecar.service.d" / "upload.conf").write_text(
        dropin_text(documented_block()))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "esi-sidecar.service" not in result.stderr, result.stderr  # the drop-in's too
