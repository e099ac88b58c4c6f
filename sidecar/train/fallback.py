"""The fallback save: one save before the final one, when the final one rests on a long upload.

The ``FALLBACK`` row of ``sidecar.train.rule`` (``SavePolicy(fallback_saves=True)``, the
default), explained; pure.

The final save is durable only once its upload ends, and the upload is the part of the
budget the job measures least well: the link is shared, and a probe or the last upload
only says how fast it was. A link that slows after the final save began (another tenant's
transfer, a congested zone) makes the final upload end after the release, and the job then
resumes from its previous durable checkpoint: all the training since is lost, two hours
where the release was the only checkpoint. The simulator's ``link-halves`` missed 16 of 200
releases so (docs/simulation.md).

So, while the deadline is still one durable save beyond the final save's budget, a
*fallback* save is made first, early enough that its upload ends before the final
checkpoint reaches the uploader::

    budget + upload < remaining <= budget + step + save + upload

(``budget``: the final save's, step + save + upload + margin; the extra step because the
rule is checked between steps). Below ``budget + upload`` (a deadline learned, or
brought forward, that late) the fallback's upload would still run when the final
checkpoint lands, delaying it or giving way to it, so none is made. The final save
follows as it always did; if its upload is cut by the release, the next machine
resumes from the fallback, one durable save earlier, instead of from the checkpoint
before. It is made only where it can pay:

- the upload is longer than the margin (a margin of at least the upload already holds a
  link at half speed; below that the fallback is what does);
- the training since the last save is at least :data:`AT_RISK_SAVES` saves long, so the
  fallback takes at most a tenth of what it protects from training (routine saves'
  floor, ``sidecar.train.routine.FLOOR_SAVES``, the same number), and longer than the
  lead itself: a save made less than one lead ago (a routine save, the user's own)
  already is the fallback, and no second fallback fits in one window, however short a
  save (the blocking part of an asynchronous save is near 0 s).

Never before the process's own end (a SIGTERM grace, a Slurm time limit: the guard
says so): there the rule is one save and leave, and the upload outlives the process.

It is never the final save: it covers no deadline, not even until the next step
(``SavePolicy.record_save(fallback=True)``), so the final save and the top-up after it are
decided as before, and a renewal leaves it a plain routine checkpoint.
"""

from __future__ import annotations

from typing import Optional

from sidecar.train.estimates import FLOOR_SAVES
from sidecar.train.rule import Situation, Why, fallback_due, render

__all__ = ["AT_RISK_SAVES", "fallback_reason"]

# The least training since the last save, in saves, for which a fallback is made: the
# routine saves' rule (at most a tenth of the training goes to saves), not a second one.
AT_RISK_SAVES = FLOOR_SAVES


def fallback_reason(
    remaining_seconds: float,
    *,
    budget_seconds: float,
    step_seconds: float,
    save_seconds: float,
    upload_seconds: Optional[float],
    margin_seconds: float,
    at_risk_seconds: float,
) -> Optional[str]:
    """Why a fallback save is due now, or None when none is: the rule's ``FALLBACK`` row
    (``sidecar.train.rule``) on these numbers alone.

    ``budget_seconds``: the final save's budget; ``save_seconds`` and ``upload_seconds``:
    the estimates in it (``upload_seconds`` None or 0: the local save is durable, no
    fallback); ``at_risk_seconds``: training since the last save."""
    situation = Situation(remaining_seconds, step_seconds, step_seconds, save_seconds,
                          upload_seconds, margin_seconds, at_risk_seconds=at_risk_seconds)
    if not fallback_due(situation, remaining_seconds, budget_seconds, step_seconds):
        return None
    lead = step_seconds + save_seconds + (upload_seconds or 0.0)
    return render(Why.FALLBACK, {"remaining": remaining_seconds, "budget": budget_seconds,
                                 "lead": lead, "upload": upload_seconds or 0.0,
                                 "margin": margin_seconds, "at_risk": at_risk_seconds})
