"""GraVAC's carried state: what its search has learnt and the current window's tallies, as a checkpoint holds them."""

from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar

from lightning_gravac.callbacks.gravac.cost import Link, Tally
from lightning_gravac.state import GainOf

#: The metadata of a field that checkpoints of earlier versions lack: loading one of them gives it its fresh value.
_ADDED = {"added": True}

_Owner = TypeVar("_Owner", bound=type)


@dataclass(kw_only=True)
class GraVACState:
    """Everything a GraVAC run carries from one fit to the next: :meth:`GraVAC.state_dict` saves each field under its
    name, in this order. Every rank holds the same values but for the current window's times and samples (``tally``),
    which the window's end reduces over ranks. The search rules read and write it (:class:`SearchRule`).

    Attributes:
        cf_min: the least aggressive factor (the sequential search promotes its candidate to it).
        candidate: the sequential search's next factor, ``cf_min x scale`` capped at ``cf_max``.
        scale: the candidate's multiple of ``cf_min``, advanced by the policy at each window's end.
        settled: the factor the sequential search settled on (two throughputs within ``omega``), else ``None``.
        gains: the smoothed gain of each probed factor.
        throughput: the last window's compression throughput of each factor sent (sequential search).
        link: the step's cost model fitted at the last window's end; ``None`` before the first.
        windows: the windows ended so far.
        progress: the steps (or epochs) of the current window so far.
        steps: the steps observed so far.
        last_probe: the step of the last probe.
        probe_interval: the steps between probes now, grown while they change nothing (``probe_backoff``).
        tally: what each factor sent during the current window cost and kept.
        gain_of: what the gains are measured on (decided at setup).
        gain_sums: the bias-corrected EWMA of each factor's gain: ``(weighted sum, weight)``.
        compress_cost: the seconds a step the method's selection and encoding cost when compressing.
        cast_cost: the seconds of the fp16 rung's casts a step.
        payload_fixed: the bytes a compressed step sends beyond ``dense / cf`` (headers, minimum entries).
        buckets: the buckets a step all-reduces: a message each.
    """

    cf_min: float
    candidate: float
    scale: float = 2.0
    settled: float | None = None
    gains: dict[float, float] = field(default_factory=dict)
    throughput: dict[float, float] = field(default_factory=dict)
    link: Link | None = None
    windows: int = 0
    progress: int = 0
    steps: int = field(default=0, metadata=_ADDED)
    last_probe: int = field(default=0, metadata=_ADDED)
    probe_interval: int = field(metadata=_ADDED)
    tally: dict[float, Tally] = field(default_factory=dict)
    gain_of: GainOf = field(metadata=_ADDED)
    gain_sums: dict[float, tuple[float, float]] = field(default_factory=dict, metadata=_ADDED)
    compress_cost: float = field(default=0.0, metadata=_ADDED)
    cast_cost: float = field(default=0.0, metadata=_ADDED)
    payload_fixed: float = field(default=0.0, metadata=_ADDED)
    buckets: int = field(default=1, metadata=_ADDED)

    def checkpoint(self) -> dict[str, Any]:
        """Each field by its name: the link and the tallies as dicts, the gain sums as lists."""
        saved = asdict(self)
        saved["gain_sums"] = {cf: list(sums) for cf, sums in self.gain_sums.items()}
        return saved

    @classmethod
    def from_checkpoint(cls, saved: dict[str, Any], fresh: "GraVACState") -> "GraVACState":
        """The state :meth:`checkpoint` saved. A field that a checkpoint of an earlier version lacks takes ``fresh``'s
        value, but ``last_probe``, which takes the restored ``steps``; one that every version saved must be there.

        Raises:
            KeyError: for a field that every version saved, missing from ``saved``.
        """
        values = {
            f.name: saved[f.name] if f.name in saved or not f.metadata.get("added") else getattr(fresh, f.name)
            for f in fields(cls)
        }
        values["last_probe"] = saved.get("last_probe", values["steps"])
        values["gains"], values["throughput"] = dict(values["gains"]), dict(values["throughput"])
        values["link"] = Link(**values["link"]) if values["link"] is not None else None
        # A window's tallies from a checkpoint before samples were counted are dropped: half a window without them
        # would weigh that factor's throughput low. The window goes on; it measures from here.
        values["tally"] = {cf: Tally(**t) for cf, t in values["tally"].items() if "samples" in t}
        values["gain_sums"] = {cf: (sums[0], sums[1]) for cf, sums in values["gain_sums"].items()}
        return cls(**values)


def carried_attributes(owner: _Owner) -> _Owner:
    """Make each field of :class:`GraVACState` an attribute of ``owner``'s instances too, read and written through
    their ``search_state``: ``controller.gains`` is ``controller.search_state.gains``, as scripts and benchmarks read
    it. The fields stay declared once, here."""

    def alias(name: str) -> property:
        def get(instance: Any) -> Any:
            return getattr(instance.search_state, name)

        def set_(instance: Any, value: Any) -> None:
            setattr(instance.search_state, name, value)

        return property(get, set_, doc=f"``search_state.{name}``.")

    for f in fields(GraVACState):
        if hasattr(owner, f.name):
            raise TypeError(f"{owner.__name__}.{f.name} exists: the carried field of that name would replace it.")
        setattr(owner, f.name, alias(f.name))
    return owner
