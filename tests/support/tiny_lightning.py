"""The tiny LightningModule the Lightning tests train: a ``Linear(4, 1)`` on MSE with SGD.

One class for the tests and their rank workers. It imports lightning, so import this module
only where lightning is installed (after ``pytest.importorskip("lightning")``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["TinyModule"]


class TinyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.layer(inputs), targets)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)
