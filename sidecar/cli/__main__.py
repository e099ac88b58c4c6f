"""``python -m sidecar.cli``: the ``esi-sidecar`` command."""

import sys

from sidecar.cli import main

sys.exit(main())
