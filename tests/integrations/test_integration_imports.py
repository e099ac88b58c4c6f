"""The integrations import in an image without torch, transformers, lightning or verl.

Run in a fresh interpreter where those packages are made unimportable (None in
sys.modules), so that this holds whatever the test environment has installed. No
server dependency may be pulled in either (ARCHITECTURE.md, "Dependency direction").
The two callback modules (Hugging Face, Lightning) are the exception: their classes
derive from the framework's, so they import it at their top and fail without it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    for name in ("torch", "transformers", "lightning", "pytorch_lightning", "verl"):
        sys.modules[name] = None  # import raises ImportError

    import importlib

    import sidecar
    import sidecar.integrations
    import sidecar.integrations.distributed as distributed
    import sidecar.integrations.verl as verl

    assert distributed.reducer_if_distributed() is None
    assert distributed.distributed_guard(client=None) is not None
    verl.configure("http://127.0.0.1:9", environ={})
    assert verl.should_save_ckpt_esi(10) is False
    verl.install()
    verl.uninstall()
    for module, framework in (("transformers", "transformers"), ("lightning", "lightning")):
        try:
            importlib.import_module("sidecar.integrations." + module)
        except ImportError as exc:
            assert framework in str(exc), exc  # the message names what to install
        else:
            raise AssertionError(module + " built a callback without its framework")

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


# Uses the callbacks as a type checker would: as annotations and as base classes. The
# frameworks themselves are skipped (follow_imports), which keeps the run to seconds.
TYPED_USE = textwrap.dedent(
    """
    from sidecar.integrations.lightning import EsiCheckpointCallback as LightningCallback
    from sidecar.integrations.transformers import EsiCheckpointCallback as HFCallback


    class MyHFCallback(HFCallback):
        pass


    class MyLightningCallback(LightningCallback):
        pass


    def saves(hf: HFCallback, pl: LightningCallback) -> int:
        return hf.saves_requested + pl.saves


    wrong: str = MyHFCallback().saves_requested
    """
)
SOURCE_ROOT = Path(__file__).resolve().parent.parent
MYPY_CONFIG = """
[mypy]
python_version = 3.11
mypy_path = {source_root}
[mypy-torch.*,transformers.*,lightning.*,pytorch_lightning.*]
follow_imports = skip
ignore_missing_imports = True
"""


def test_mypy_sees_the_callback_classes(tmp_path: Path) -> None:
    """IDEs and mypy see ``EsiCheckpointCallback``: a class, its attributes typed."""
    mypy_api = pytest.importorskip("mypy.api")
    snippet = tmp_path / "typed_use.py"
    snippet.write_text(TYPED_USE, encoding="utf-8")
    config = tmp_path / "mypy.ini"
    config.write_text(MYPY_CONFIG.format(source_root=SOURCE_ROOT), encoding="utf-8")
    stdout, stderr, _status = mypy_api.run(
        ["--config-file", str(config), "--cache-dir", str(tmp_path / "cache"),
         "--no-error-summary", "--hide-error-context", str(snippet)]
    )
    errors = [line for line in stdout.splitlines() if ": error:" in line]
    wrong_line = TYPED_USE.splitlines().index(
        "wrong: str = MyHFCallback().saves_requested") + 1
    # Only the deliberate mistake: an int attribute put into a str, found because the
    # class and its attributes are known to mypy.
    assert len(errors) == 1, stdout + stderr
    assert f"typed_use.py:{wrong_line}: error: Incompatible types in assignment" in errors[0]
