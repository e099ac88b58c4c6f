"""Imported by Python at start-up in every process a test starts (``PYTHONPATH`` names this
folder): installs the loopback guard of ``tests/support/loopback_guard.py``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
try:
    import loopback_guard
finally:
    del sys.path[0]
loopback_guard.install()
