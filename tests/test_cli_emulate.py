"""``esi-sidecar emulate`` on a port that is taken: one line, exit 2, as ``serve`` says it
(issue 39, item 9). In-process, on a loopback port this test holds."""

from __future__ import annotations

import socket

import pytest

from sidecar.cli import main


@pytest.mark.parametrize("cloud", ["volcengine", "aws", "gcp", "azure"])
def test_emulate_on_a_busy_port_says_one_line_and_exits_2(
    cloud: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["emulate", "--cloud", cloud, "--listen", f"127.0.0.1:{port}"]) == 2
    said = capsys.readouterr()
    assert said.err.splitlines() == [
        f"esi-sidecar emulate: cannot listen on 127.0.0.1:{port}: Address already in use "
        "(another --listen HOST:PORT?)"]
    assert "Traceback" not in said.err and "emulator on" not in said.out
