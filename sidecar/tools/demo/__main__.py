"""``python -m sidecar.tools.demo``: the same as ``esi-sidecar demo``."""

import sys

from sidecar.cli import main

sys.exit(main(["demo", *sys.argv[1:]]))
