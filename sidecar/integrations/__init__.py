"""Framework integrations for the training side; each needs its framework only when imported.

- :mod:`sidecar.integrations.distributed`: ``TorchReducer`` (the ``Reducer`` for
  ``torch.distributed``), ``reducer_if_distributed()`` and ``distributed_guard()``, so that
  every rank saves at the same step.
- :mod:`sidecar.integrations.verl`: ``should_save_ckpt_esi`` with verl's signature, asking
  the daemon first; ``install()`` puts it in place of verl's own.
- :mod:`sidecar.integrations.transformers`: ``EsiCheckpointCallback`` for the Hugging Face
  ``Trainer``.
- :mod:`sidecar.integrations.lightning`: ``EsiCheckpointCallback`` for ``lightning.Trainer``.

Nothing here is imported by ``import sidecar``: this package must import in an image
holding only the base install, and importing one integration never imports another
framework (ARCHITECTURE.md, "Dependency direction"). The callback modules
(``transformers``, ``lightning``) import their framework at their top, since their
classes derive from its callback class; the others import theirs lazily. See
docs/integrations.md.
"""

from __future__ import annotations

__all__: list[str] = []
