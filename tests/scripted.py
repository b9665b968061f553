"""Controllers driven by hand for scripted tests: GraVAC whose gains and step times are functions of the factor, and
the default rule on a scripted link."""

import math

from lightning_gravac import GraVAC, StepStats


class Scripted(GraVAC):
    """GraVAC driven by hand: gains and step times are functions of the factor.

    By default a step takes 1 s of compute plus 1 s of dense communication divided by the factor.
    """

    def __init__(
        self,
        gain_at,
        seconds_of=lambda cf: 1.0 + 1.0 / cf,
        comm_of=lambda cf: 0.0,
        compress_of=lambda cf: 0.0,
        **kwargs,
    ):
        kwargs.setdefault("search", "sequential")  # the paper's search, unless a test asks for the model search
        super().__init__(**kwargs)
        self.gain_at, self.seconds_of, self.comm_of, self.compress_of = gain_at, seconds_of, comm_of, compress_of
        self.sent: list[float] = []

    def step_seconds(self, stats: StepStats) -> float:
        return self.seconds_of(self.cf)

    def run(self, steps: int, state=None) -> "Scripted":
        """``steps`` steps; with a ``CompressionState``, probing only where :meth:`apply` asks for probes."""
        for _ in range(steps):
            self.sent.append(self.cf)
            if state is not None:
                self.apply(state)
            probes = self.probe_cfs if state is None else tuple(state.probe_cfs)
            gain = 1.0 if self.cf == 1 else self.gain_at(self.cf)
            dense = 1_000_000
            stats = StepStats(
                bytes_sent=dense if self.cf == 1 else int(dense / self.cf), bytes_dense=dense, sq_norm=1.0,
                sq_norm_sent=gain, buckets=1, probe_cfs=probes, probe_sq=[self.gain_at(c) for c in probes],
                probe_basis=1.0, comm_s=self.comm_of(self.cf), compress_s=self.compress_of(self.cf),
            )  # fmt: skip
            self.observe(stats, None)
        return self


def default_on_a_link(per_byte: float, gain: dict[float, float], state=None, **kwargs) -> Scripted:
    """The default rule on a scripted link: 0.1 s of compute, 1 MB dense, ``per_byte`` s a moved byte (2 ranks);
    with ``state``, attached to that compression state (its method and the momentum moved into its hook)."""

    def seconds(cf: float) -> float:
        return 0.1 + 1_000_000 / cf * per_byte  # two ranks: a rank moves the payload, or the dense buffer once

    budget_steps = kwargs.pop("budget_steps", math.inf)
    variance_weight = kwargs.pop("variance_weight", None)
    c = Scripted(lambda cf: gain[cf], seconds, search="model", **kwargs)
    c.probes.variance_weight = variance_weight  # as the probe steps would have measured it
    c.cost.world_size = 2
    c.compression_state = state
    c.budget.steps = budget_steps  # what fit start reads from the trainer
    c.cost.timed = (0.0, per_byte)  # what the fit-start timing would have measured
    c.cost.cast_cost, c.cost.half_per_byte = 0.01, per_byte  # the fp16 rung: casts 10 ms a step, bytes as fp32's
    return c.run(4)  # the first window (3 steps), then one step at the factor it chose
