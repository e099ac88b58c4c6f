"""verl ends ``fit`` normally at a release; ``exit_if_released(trainer)`` turns that into exit
status 75, as every other integration does (issue 39, smaller)."""

from __future__ import annotations

import types

import pytest

import sidecar.integrations.verl as esi
from sidecar.integrations.verl_trainer import RELEASED_ATTRIBUTE
from sidecar.train.release_wait import EXIT_RELEASED


def test_a_trainer_stopped_for_the_release_exits_75_and_one_that_finished_returns() -> None:
    finished = types.SimpleNamespace()
    esi.exit_if_released(finished)  # training ended on its own: returns
    released = types.SimpleNamespace(**{RELEASED_ATTRIBUTE: True})
    with pytest.raises(SystemExit) as leaving:
        esi.exit_if_released(released)
    assert leaving.value.code == EXIT_RELEASED == 75
