"""The training side: what runs inside the training process.

Standard library only, so that it imports in any training image: the HTTP client, the
deadline tracker, the guard and the save rule (the checkpoint format is
``sidecar.checkpoint``, shared with the daemon). It imports nothing from ``sidecar.host``
nor any third-party package (``tests/test_layout.py`` enforces it). The public names are
re-exported by ``sidecar``.
"""
