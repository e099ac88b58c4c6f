"""The integrations import in an image without torch, transformers, lightning or verl.

Run in a fresh interpreter where those packages are made unimportable (None in
sys.modules), so that this holds whatever the test environment has installed. No
server dependency may be pulled in either (ARCHITECTURE.md, "Dependency direction").
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    for name in ("torch", "transformers", "lightning", "pytorch_lightning", "verl"):
        sys.modules[name] = None  # import raises ImportError

    import sidecar.integrations
    import sidecar.integrations.distributed as distributed
    import sidecar.integrations.lightning as lightning
    import sidecar.integrations.transformers as transformers
    import sidecar.integrations.verl as verl

    assert distributed.reducer_if_distributed() is None
    assert distributed.distributed_guard(client=None) is not None
    verl.configure("http://127.0.0.1:9", environ={})
    assert verl.should_save_ckpt_esi(10) is False
    verl.install()
    verl.uninstall()
    for module in (transformers, lightning):
        try:
            module.EsiCheckpointCallback
        except ImportError:
            pass
        else:
            raise AssertionError(module.__name__ + " built a callback without its framework")

    server = {"fastapi", "uvicorn", "pydantic", "dateutil", "starlette", "volcenginesdkcore"}
    loaded = server & {name.split(".")[0] for name in sys.modules}
    assert not loaded, loaded
    print("ok")
    """
)


def test_integrations_import_without_frameworks() -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
