"""The gains GraVAC's hook probes (:class:`Probes`): each factor's, smoothed, and how far apart the probes are."""

from dataclasses import Field, dataclass, field
from typing import Any

from lightning_gravac.callbacks.gravac.checkpoint import Checkpointed, checkpointed
from lightning_gravac.compressors.base import Compressor
from lightning_gravac.state import GainOf


def _pair(saved: list[float] | None) -> tuple[float, float] | None:
    return None if saved is None else (saved[0], saved[1])


def _sums(saved: dict[float, list[float]]) -> dict[float, tuple[float, float]]:
    return {cf: (sums[0], sums[1]) for cf, sums in saved.items()}


@dataclass(kw_only=True)
class Probes(Checkpointed):
    """What the hook's probes measured: the gain of each factor probed, smoothed over the steps, and when it probes.

    Attributes:
        gains: the smoothed gain of each probed factor.
        last_probe: the step of the last probe.
        probe_interval: the steps between probes now, grown while they change nothing (``probe_backoff``).
        gain_of: what the gains are measured on, ``"error_fed"`` or ``"gradient"`` (decided at setup).
        gain_sums: the bias-corrected EWMA of each factor's gain: ``(weighted sum, weight)``.
        probe_every: after the first window, the gains are measured on one step in this many.
        probe_backoff: how far the spacing grows while probes change nothing: up to ``probe_every x probe_backoff``.
        bias_corrected: smooth by a bias-corrected EWMA (the model search's), else by the paper's, started at the first
            value.
        variance_weight: how much an unbiased code's variance counts against the batches' own noise
            (:meth:`~lightning_gravac.state.StepStats.variance_weight`), smoothed as the gains are: ``(weighted sum,
            weight)``; ``None`` before a probe step measured it (it then counts in full).
        gain_of_default: ``gain_of`` was left to the search's default, settled at setup by the method.
        alpha: the EWMA factor of the gains; ``None``: the paper's ``N/100`` over ``N`` ranks, in [0.02, 0.5].
    """

    gains: dict[float, float] = field(default_factory=dict, metadata=checkpointed(restore=dict))
    last_probe: int = field(default=0, metadata=checkpointed(added=True))
    probe_interval: int = field(metadata=checkpointed(added=True))
    gain_of: GainOf = field(metadata=checkpointed(added=True))
    gain_sums: dict[float, tuple[float, float]] = field(
        default_factory=dict, metadata=checkpointed(added=True, restore=_sums)
    )
    variance_weight: tuple[float, float] | None = field(default=None, metadata=checkpointed(added=True, restore=_pair))
    probe_every: int
    probe_backoff: int
    bias_corrected: bool
    gain_of_default: bool = False
    alpha: float | None = None

    def smoothing(self, world_size: int) -> float:
        """The gains' smoothing factor in force over ``world_size`` ranks."""
        return self.alpha if self.alpha is not None else max(0.02, min(0.5, world_size / 100))

    def take(
        self, measured: dict[float, float], steps: int, world_size: int, variance_weight: float | None = None
    ) -> None:
        """Smooth a step's probes (``measured``: the gain by factor, and the ``variance_weight`` it measured) into
        :attr:`gains`. The gains decay per step: a probe after ``p`` steps without one weighs ``1 - (1 - alpha)^p``
        (:meth:`smoothing` over ``world_size`` ranks). ``steps``: the steps so far, this one's."""
        if not measured:
            return
        alpha = self.smoothing(world_size)
        weight = 1 - (1 - alpha) ** (steps - self.last_probe)
        if variance_weight is not None:
            total, mass = self.variance_weight or (0.0, 0.0)
            self.variance_weight = ((1 - weight) * total + weight * variance_weight, (1 - weight) * mass + weight)
        self.last_probe = steps
        for cf, gain in measured.items():
            if self.bias_corrected:  # the weights of the probes so far, normalised
                total, mass = self.gain_sums.get(cf, (0.0, 0.0))
                total, mass = (1 - weight) * total + weight * gain, (1 - weight) * mass + weight
                self.gain_sums[cf] = (total, mass)
                self.gains[cf] = total / mass
            else:
                self.gains[cf] = gain if cf not in self.gains else (1 - weight) * self.gains[cf] + weight * gain

    def fit_method(self, method: Compressor) -> None:
        """At setup: a method that selects from an accumulation of its own (DGC) has no gain of the step's gradient
        alone, so its gains are of the error-fed gradient where ``gain_of`` was left to the default.

        Raises:
            ValueError: for ``gain_of="gradient"`` asked with such a method.
        """
        if self.gain_of_default and method.owns_feedback:
            self.gain_of = "error_fed"
        if self.gain_of == "gradient" and method.owns_feedback:
            raise ValueError(
                f"`gain_of='gradient'` measures what a factor keeps of the step's own gradient, but {method.name!r} "
                "selects from an accumulation of its own, not from the gradient. Use `gain_of='error_fed'`."
            )

    @property
    def weight_of_variance(self) -> float:
        """The smoothed :attr:`variance_weight`; 1 before one was measured."""
        return 1.0 if self.variance_weight is None else self.variance_weight[0] / self.variance_weight[1]

    def due(self, steps: int) -> bool:
        """Whether a step after ``steps`` steps falls on the probes' spacing."""
        return steps % self.probe_interval == 0

    def space(self, changed: bool, probed: bool) -> None:
        """The probes' spacing after a step: a probe after the first window that leaves the choice as it was
        (``probed``) doubles it, up to ``probe_every x probe_backoff`` steps; a change of choice (``changed``) brings it
        back to ``probe_every``."""
        if changed:
            self.probe_interval = self.probe_every
        elif probed:
            self.probe_interval = min(2 * self.probe_interval, self.probe_every * self.probe_backoff)

    def fresh(self, f: Field[Any], saved: dict[str, Any]) -> Any:
        """A checkpoint without probes' spacing starts from ``probe_every``, one without a last probe from its step
        count, one without ``gain_of`` keeps this run's."""
        if f.name == "last_probe":
            return saved.get("steps", 0)
        if f.name == "probe_interval":
            return self.probe_every
        if f.name == "gain_of":
            return self.gain_of
        return super().fresh(f, saved)
