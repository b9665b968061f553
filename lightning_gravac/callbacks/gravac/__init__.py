"""GraVAC: the controller (``controller.py``) and its parts: what it carries in checkpoints (``state.py``), its factors
(``ladder.py``), its decision rules (``search.py``), its steps and windows (``window.py``), what its model search
predicts (``prediction.py``), what it sends for Adam (``hold.py``), the cost model of a step (``cost.py``) and the
link probe (``probe.py``)."""

from lightning_gravac.callbacks.gravac.controller import GraVAC
from lightning_gravac.callbacks.gravac.cost import DENSE, Link, Tally, fit_link, moved_bytes
from lightning_gravac.callbacks.gravac.ladder import DEFAULT_CF_MAX, DEFAULT_CF_MIN
from lightning_gravac.callbacks.gravac.probe import PROBE_BYTES, PROBE_SECONDS, LinkProbe
from lightning_gravac.callbacks.gravac.search import SEARCH_DEFAULTS, SEARCHES, SearchRule
from lightning_gravac.callbacks.gravac.state import GraVACState

__all__ = [
    "DEFAULT_CF_MAX",
    "DEFAULT_CF_MIN",
    "DENSE",
    "PROBE_BYTES",
    "PROBE_SECONDS",
    "SEARCHES",
    "SEARCH_DEFAULTS",
    "GraVAC",
    "GraVACState",
    "Link",
    "LinkProbe",
    "SearchRule",
    "Tally",
    "fit_link",
    "moved_bytes",
]
