from __future__ import annotations

import sys
from pathlib import Path

# Tests import the harness next to them as a plain module.
sys.path.insert(0, str(Path(__file__).parent))
