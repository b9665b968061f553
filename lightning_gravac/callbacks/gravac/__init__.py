"""GraVAC: the controller, its decision rules, its cost model of a step and its link probe."""

from lightning_gravac.callbacks.gravac.controller import GraVAC
from lightning_gravac.callbacks.gravac.cost import DENSE, Link, Tally, fit_link, moved_bytes
from lightning_gravac.callbacks.gravac.probe import PROBE_BYTES, PROBE_SECONDS, LinkProbe
from lightning_gravac.callbacks.gravac.search import (
    DEFAULT_CF_MAX,
    DEFAULT_CF_MIN,
    SEARCH_DEFAULTS,
    SEARCHES,
    SearchRule,
)
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
