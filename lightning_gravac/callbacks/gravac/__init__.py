"""GraVAC: the controller (``controller.py``) composes its parts, each an object with its own state, and hands them
the values they need: the factors and the sequential search's walk along them (:class:`Ladder`, with the run's
:class:`Budget`, ``ladder.py``), the gains the hook probes (:class:`Probes`, ``probes.py``), the steps and windows
(:class:`Window`, ``window.py``) and the cost model of a step (:class:`CostModel`, ``cost.py``). Each declares the
fields a checkpoint holds (``checkpoint.py``). The decision rules (``search.py``), the model search's predictions
(``prediction.py``) and what it sends for Adam (``hold.py``) hold no state; the link timer (``link_timer.py``) times
all-reduces at fit start. No part knows the controller."""

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
