"""Host-side checkpoint upload to S3-compatible storage, and restore (issue "Checkpoint
safety", items 3 and 4).

The uploader runs inside the daemon (``esi-sidecar serve --upload-from DIR --upload-to
s3://bucket/prefix``), outside the training container, so it keeps going while the
trainer is busy or dead. ``esi-sidecar restore`` brings the newest complete remote
checkpoint back onto a fresh machine. See docs/upload.md.

Modules, one job each:

- ``plan``: the next upload's estimate and which upload goes first near the release
  (pure, standard library only; the simulator runs the same rule);
- ``location``: ``s3://bucket/prefix`` and the key layout (standard library only);
- ``storage_config``: where and how to reach storage (standard library only: a volume's
  uploader reads it too, and never loads boto3);
- ``storage``: the boto3 client and transfer settings, errors in one clear line;
- ``transfer``: one checkpoint up (manifest last) or down (verified);
- ``stream``: saves in progress, and which of their files are finished (sent early);
- ``commit_check``: every file sent early checked against the manifest that lands;
- ``volume_stage``, ``s3_stage``: the files at the destination before the commit (a hidden
  folder; multipart uploads completed at the commit), unchanged ones linked or copied;
- ``status``: what ``GET /v1/uploads`` and ``/metrics`` show (standard library only);
- ``inotify``: one inotify instance and its reader thread, for every watch (Linux);
- ``watch``: the checkpoint folder watched, polling as the fallback;
- ``destination``: what a destination (S3 / TOS, a volume) does for the uploader;
- ``uploader``: the daemon's thread, the commit loop: order, retries, pins, yielding near
  the release;
- ``idle``: its work while no commit waits (streaming, S3 references, the link probe);
- ``restore``: the ``esi-sidecar restore`` command's work.

This file imports nothing on purpose: the daemon imports the package only when upload is
configured, and ``sidecar.host.settings`` only needs ``location`` to check a URL (the
simulator imports ``plan`` alone). Only an ``s3://`` destination loads the S3 modules
(``storage``, ``transfer``, ``s3_*``) and with them boto3.
"""
