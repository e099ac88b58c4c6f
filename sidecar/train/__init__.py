"""The training side: what runs inside the training process.

Standard library only, so that it imports in any training image: the HTTP client, the
deadline tracker, the guard, the save rule, and the checkpoint format with its
crash-safe writes. It imports nothing from ``sidecar.host`` nor any third-party package
(``tests/test_layout.py`` enforces it). The public names are re-exported by ``sidecar``.
"""
