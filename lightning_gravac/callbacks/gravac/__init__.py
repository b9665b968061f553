"""GraVAC: the controller (``controller.py``) composes its parts, each an object with its own state, and hands them
the values they need: the factors and the sequential search's walk along them (:class:`Ladder`, with the run's
:class:`Budget`, ``ladder.py``), the gains the hook probes (:class:`Probes`, ``probes.py``), the steps and windows
(:class:`Window`, ``window.py``), the cost model of a step (:class:`CostModel`, ``cost.py``) and whether it runs local
steps (:class:`Rounds`, ``rounds.py``). Each declares the fields a checkpoint holds (``checkpoint.py``). What it sends
for an Adam-like optimizer or clipped gradients (:class:`Hold`, ``hold.py``), this rank's step times
(:class:`StepClock`, ``clock.py``) and the link timer (``link_timer.py``, all-reduces and a step's own work timed at
fit start) hold what a fit measures; the decision rules (``search.py``) and the model search's predictions
(``prediction.py``) hold no state. No part knows the controller."""

from lightning_gravac.callbacks.gravac.controller import GraVAC
from lightning_gravac.callbacks.gravac.cost import DENSE, CostModel, Link, Tally, fit_link, moved_bytes
from lightning_gravac.callbacks.gravac.ladder import DEFAULT_CF_MAX, DEFAULT_CF_MIN, Budget, Ladder
from lightning_gravac.callbacks.gravac.link_timer import TIMED_BYTES, TIMED_SECONDS, LinkTimer
from lightning_gravac.callbacks.gravac.probes import Probes
from lightning_gravac.callbacks.gravac.search import SEARCH_DEFAULTS, SEARCHES, SearchRule
from lightning_gravac.callbacks.gravac.window import Window

__all__ = [
    "DEFAULT_CF_MAX",
    "DEFAULT_CF_MIN",
    "DENSE",
    "SEARCHES",
    "SEARCH_DEFAULTS",
    "TIMED_BYTES",
    "TIMED_SECONDS",
    "Budget",
    "CostModel",
    "GraVAC",
    "Ladder",
    "Link",
    "LinkTimer",
    "Probes",
    "SearchRule",
    "Tally",
    "Window",
    "fit_link",
    "moved_bytes",
]
