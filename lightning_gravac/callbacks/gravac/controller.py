"""GraVAC: gradient-variance-aware adaptive compression (Tyagi & Swany, IEEE CLOUD 2023), the controller: it composes
its parts (the package's docstring lists them) and hands each the values it needs."""

from dataclasses import replace
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_gravac._validation import choice, fraction, nonnegative, whole
from lightning_gravac.adaptations.momentum import MomentumCorrection
from lightning_gravac.callbacks.controller import Controller
from lightning_gravac.callbacks.gravac.checkpoint import CHECKPOINT_ORDER, Checkpointed
from lightning_gravac.callbacks.gravac.clock import StepClock
from lightning_gravac.callbacks.gravac.cost import DENSE, CostModel, Tally, moved_in_step
from lightning_gravac.callbacks.gravac.hold import AdamPolicy, Hold
from lightning_gravac.callbacks.gravac.ladder import DEFAULT_CF_MAX, DEFAULT_CF_MIN, Budget, Ladder, Policy
from lightning_gravac.callbacks.gravac.link_timer import LinkTimer, link_said
from lightning_gravac.callbacks.gravac.prediction import Decision, kept, masking_weight, progress_per_second, say_choice
from lightning_gravac.callbacks.gravac.probes import Probes
from lightning_gravac.callbacks.gravac.rounds import Rounds
from lightning_gravac.callbacks.gravac.search import SEARCH_DEFAULTS, SEARCHES, Search
from lightning_gravac.callbacks.gravac.window import Interval, Reduce, Window
from lightning_gravac.compressors.base import Compressor, validate_cf
from lightning_gravac.state import HALF, CompressionState, Factors, GainOf, StepStats


class GraVAC(Controller):
    """Adapt the compression factor to what compression loses (gain) and what the link costs (step time).

    Each step it sends the factor of highest predicted progress a second among dense and a ladder of factors
    (``cf_min, x2, x4, x16, ...`` up to ``cf_max``), from the link measured at fit start, the steps sent and the gains
    the hook probes. Under Adam or AdamW it sends dense or fp16 while Adam's second moment settles, then Adam's first
    moment compressed. As the strategy's zero-argument default under SGD it may switch to local steps where a round's
    one compressed update costs less (:mod:`.rounds`). Every rank decides alike. ``GraVAC(search="sequential")`` is the
    paper's GraVAC (Tyagi & Swany, IEEE CLOUD 2023). The rules, and why they depart from the paper:
    ``docs/algorithms.md``.

    Args:
        cf_min: least aggressive factor. ``None``: 10, or the size of the model's largest gradient if smaller.
        cf_max: most aggressive factor. ``None``: 1000, or the size of the model's largest gradient if smaller. A
            value passed is kept: one the model cannot honour raises at setup.
        epsilon: the gain a factor must keep to be sent, in (0, 1]. ``None``: 0.02 (model), 0.7 (sequential).
        omega: relative tolerance for promotion and plateau, in (0, 1].
        window: steps (or epochs) between search decisions (the model search's refits of the step's cost).
            ``None``: 50 (model), 500 (sequential).
        policy: how the ladder (or the candidate) advances, ``"exponential"`` or ``"geometric"``.
        alpha: EWMA factor of the gains, in (0, 1]. ``None``: the paper's ``N/100`` clamped to [0.02, 0.5].
        interval: unit of ``window``, ``"step"`` or ``"epoch"``.
        search: ``"model"`` (the default) or ``"sequential"`` (the paper's).
        probe_every: after the first window, the gains are measured on one step in this many. ``None``: 25 (model),
            1 (sequential).
        first_window: length of the first window (in ``interval`` units). ``None``: 3 (model), ``window`` (sequential).
        gain_of: what the gains are of, ``"error_fed"`` (gradient plus residual) or ``"gradient"`` (the step's own).
            ``None``: ``"gradient"`` for the model search unless the method keeps an accumulation of its own (DGC),
            else ``"error_fed"``.
        gain_power: a factor's progress is weighed as ``gain ** gain_power``. ``None``: 1/3 (model), 1 (sequential).
        time_link: measure the link at fit start, before the first step. ``None``: on for the model search.
        adam: under an optimizer that divides each coordinate by a running second moment (Adam, AdamW, RMSprop,
            Adagrad) and a lossy method, the optimizer left as configured: ``"gradient"`` sends each step dense, whole
            in fp16 or, with a block code (``int8``, ``int4``), in that code, whichever the cost model predicts
            fastest; ``"fp16"`` dense or fp16 only; ``"dense"`` holds factor 1; ``"compress"`` searches on the
            gradients as with SGD. ``"moment"`` (1-bit Adam's scheme, which changes the optimizer) holds the first
            tenth of an Adam or AdamW run as ``"fp16"`` does, then sends each rank's first moment compressed, the second
            frozen (docs/optimizers.md says what it was measured to cost).
        probe_backoff: each probe after the first window that leaves the choice as it was doubles the probes'
            spacing, up to ``probe_every x probe_backoff`` steps. ``None``: 8 (model), 1 (sequential).
        fp16_rung: let the model search send a step whole in fp16 (turned off at setup where it cannot be sent).
            ``None``: off.
        weigh_masking: weigh each factor's progress by the momentum that momentum factor masking keeps at it.
        weigh_noise: weigh an unbiased code's variance against the noise the ranks' batches already carry (measured on
            the steps that probe), rather than against the whole gradient's energy (model search).
        budget: leave out the factors whose entries would wait longer than the run's steps, and make the most
            aggressive one it admits the ladder's last rung (model search).

    Raises:
        ValueError: for a factor below 1, ``cf_min > cf_max``, ``epsilon``/``omega``/``alpha`` outside (0, 1], a
            window or first window below 1, a negative ``gain_power``, or an unknown policy, interval, search or
            ``gain_of``; at setup, ``gain_of="gradient"`` with a method that keeps its own accumulation (DGC).
    """

    def __init__(
        self,
        cf_min: float | None = None,
        cf_max: float | None = None,
        epsilon: float | None = None,
        omega: float = 0.01,
        window: int | None = None,
        policy: Policy = "exponential",
        alpha: float | None = None,
        interval: Interval = "step",
        search: Search = "model",
        probe_every: int | None = None,
        first_window: int | None = None,
        gain_of: GainOf | None = None,
        gain_power: float | None = None,
        time_link: bool | None = None,
        adam: AdamPolicy = "gradient",
        probe_backoff: int | None = None,
        fp16_rung: bool | None = None,
        weigh_masking: bool = True,
        weigh_noise: bool = True,
        budget: bool = True,
    ) -> None:
        default_bounds = {"cf_min": cf_min is None, "cf_max": cf_max is None}
        cf_min = DEFAULT_CF_MIN if cf_min is None else validate_cf(cf_min, "cf_min")
        cf_max = DEFAULT_CF_MAX if cf_max is None else validate_cf(cf_max, "cf_max")
        if cf_min > cf_max:
            raise ValueError(f"`cf_min` ({cf_min:g}) must not exceed `cf_max` ({cf_max:g}).")
        super().__init__(cf=cf_min)
        self.search = choice(search, "search", tuple(SEARCHES))
        #: The decision rule of ``search`` (:class:`SearchRule`).
        self.rule, defaults = SEARCHES[self.search], SEARCH_DEFAULTS[self.search]
        length = whole(defaults["window"] if window is None else window, "window")
        self.epsilon = fraction(defaults["epsilon"] if epsilon is None else epsilon, "epsilon")
        self.omega = fraction(omega, "omega")
        alpha = None if alpha is None else fraction(alpha, "alpha")
        policy = choice(policy, "policy", ("exponential", "geometric"))
        interval = choice(interval, "interval", ("step", "epoch"))
        probe_every = whole(defaults["probe_every"] if probe_every is None else probe_every, "probe_every")
        gain_basis: GainOf = choice(defaults["gain_of"] if gain_of is None else gain_of, "gain_of",
                                    ("error_fed", "gradient"))  # fmt: skip
        self.gain_power = nonnegative(defaults["gain_power"] if gain_power is None else gain_power, "gain_power")
        self.time_link = bool(defaults["time_link"] if time_link is None else time_link)
        #: What it sends for an Adam-like optimizer or clipped gradients.
        self.hold = Hold(policy=choice(adam, "adam", ("gradient", "moment", "fp16", "dense", "compress")))
        probe_backoff = whole(defaults["probe_backoff"] if probe_backoff is None else probe_backoff,
                              "probe_backoff")  # fmt: skip
        #: Whether the model search may send a step whole in fp16 (decided at setup: fp32 gradients, a method whose
        #: residual the hook keeps, ``cf_min`` above 2).
        self.fp16_rung = bool(defaults["fp16_rung"] if fp16_rung is None else fp16_rung)
        #: The gradients' dtype: the largest trainable parameter's, set at setup (what an entry's wait is counted in).
        self.weigh_masking, self.grad_dtype = bool(weigh_masking), torch.float32
        self.weigh_noise = bool(weigh_noise)
        #: The run's length, which bounds the factors (model search).
        self.budget = Budget(on=bool(budget) and self.rule.models_cost)
        if self.fp16_rung and not self.rule.models_cost:
            raise ValueError("`fp16_rung=True` needs `search='model'`: the sequential search has no cost model for it.")
        # The user's choice, which `fp16_rung` is derived from at each setup and fit; a ladder from 2 or less has the
        # factor already.
        self.fp16_rung_asked, self.fp16_rung = self.fp16_rung, self.fp16_rung and cf_min > HALF
        first = self.rule.first_window(length) if first_window is None else whole(first_window, "first_window")

        # The parts, each holding its share of what a checkpoint carries; every rank holds the same values but for the
        # current window's times and samples.
        #: The factors, and the sequential search's walk along them.
        self.ladder = Ladder.between(cf_min, cf_max, policy, default_bounds)
        #: The gains the hook probes, smoothed, and the probes' spacing.
        self.probes = Probes(probe_interval=probe_every, gain_of=gain_basis, probe_every=probe_every,
                             probe_backoff=probe_backoff, bias_corrected=self.rule.corrects_bias,
                             gain_of_default=gain_of is None, alpha=alpha)  # fmt: skip
        #: The steps and windows so far, and the current window's tallies.
        self.window = Window(length=length, first=first, interval=interval)
        #: What a step costs: the link timed at fit start, the model fitted to the windows' steps.
        self.cost = CostModel()
        #: Whether the default runs local steps, from when (the strategy allows it for its zero-argument default).
        self.rounds = Rounds()
        #: This rank's steps: the one under way's start and samples, and the fit's first step apart.
        self.clock = StepClock()
        self._timer: LinkTimer | None = None  # the fit's link timer, once it has timed

    @override
    def fit_to_model(self, largest: int) -> None:
        """Fit the default bounds to the method and the model's largest gradient (:meth:`Ladder.fit_bounds`)."""
        method = self.compression_state.compressor if self.compression_state is not None else None
        reach = method.factor_range(self.grad_dtype) if method is not None else None
        if self.ladder.fit_bounds(reach, largest, method.name if method else "") and self.cf not in (DENSE, HALF):
            self.cf = self.ladder.clamp(self.cf)  # dense or fp16 (a resumed run's factor) stay what they are

    @property
    def probe_cfs(self) -> tuple[float, ...]:
        """The factors whose gain the hook measures each step."""
        return self.rule.probe_cfs(self.ladder, self.window.settled)

    @property
    @override
    def max_cf(self) -> tuple[str, float]:
        return "cf_max", self.ladder.cf_max

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self.cost.world_size = trainer.world_size
        super().setup(trainer, pl_module, stage)
        self.probes.fit_method(self.state.compressor)
        trainable = [p for p in pl_module.parameters() if p.requires_grad]
        self.grad_dtype = max(trainable, key=lambda p: p.numel()).dtype if trainable else torch.float32
        self.check_rung(pl_module)

    def check_rung(self, pl_module: "pl.LightningModule") -> None:
        """Turn the fp16 rung off where it cannot be sent, on for the hold (:meth:`Hold.rung`), from the user's choice
        rather than from what the last fit derived: a held fit's rung does not outlive that fit. At setup, and again at
        fit start for layers built in configure_model."""
        fp32 = all(p.dtype == torch.float32 for p in pl_module.parameters() if p.requires_grad)
        method, models_cost = self.state.compressor, self.rule.models_cost
        self.fp16_rung = self.hold.rung(self.fp16_rung_asked, self.adaptive_optimizer, method, fp32, self.ladder.cf_min,
                                        models_cost)  # fmt: skip

    def holding(self) -> bool:
        """Whether the next step is held for the optimizer or the clipping (:meth:`Hold.holds`): no gains to measure."""
        return self.hold.holds(self.adaptive_optimizer, self.moments_moved())

    @property
    @override
    def moves_moments(self) -> bool:
        return self.hold.moves_moments

    @property
    def rungs(self) -> tuple[float, ...]:
        """The factors the model search weighs besides dense and the ladder: ``HALF`` (fp16) when on."""
        return (HALF,) if self.fp16_rung and self.cost.half_per_byte is not None else ()

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self.hold.fit(bool(trainer.gradient_clip_val), self.state.compressor, float(trainer.estimated_stepping_batches))
        super().on_fit_start(trainer, pl_module)
        self.clock.step = -1  # a fit's first batch starts a step, whatever step a fit before ended at
        self._timer, self.rounds.time_work = None, None
        model_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
        if self.rounds.every:  # resumed in local steps; a first round's length is chosen again from these
            self.cost.model_bytes = model_bytes
            self.budget.steps = float(trainer.estimated_stepping_batches)
            self.rounds.run(self.state, fresh=False)
            return
        if not self.rule.models_cost:
            self._start_hold()
            return
        self.check_rung(pl_module)
        self.cost.model_bytes = model_bytes
        fresh = self.window.steps == 0  # not a resumed run, whose next factor was decided before the checkpoint
        if self.budget.on:  # the same on every rank: the trainer's settings and the data's length
            self.budget.steps = float(trainer.estimated_stepping_batches)
            self.budget.fit(self.ladder, self.state.compressor, self.grad_dtype, self.rungs)
        self.clock.warm_up = True  # a resumed run's first step allocates and builds DDP's buckets again too
        self.cost.first_step = None
        if self.time_link and trainer.world_size > 1:
            self._measure_at_start(trainer, fresh)
            if fresh:
                self.cf = self.choose()
                self.apply(self.state)
                say_choice(self.cost, self.cf, None, self.rungs, self.window.steps)
        self._start_hold()
        # The fp16 rung of a held fit is known from here on: a resumed run's next step may be a half one.
        self.apply(self.state)

    def _start_hold(self) -> None:
        """Where the steps are held: the factor of the first step (a resumed run's too), and what is sent, said."""
        if self.holding():
            self.cf = self.choose()
            self.apply(self.state)
            self.hold.say(self.state.compressor, bool(self.state.rows.rows), self.rungs, self.rule.models_cost,
                          self.fp16_rung, moments_move=self.state.carry.sends_from is not None)  # fmt: skip

    def _measure_at_start(self, trainer: "pl.Trainer", fresh: bool) -> None:
        """Measure the link (:meth:`measure_link`), said on rank 0, and with the fp16 rung what an fp16 step costs
        (:meth:`measure_half`); ``fresh``: not a resumed run."""
        cost = self.cost
        cost.timed = self.measure_link(trainer)
        runs = self._timer.per_byte_runs if self._timer is not None else None  # their spread, where the link was timed
        rank_zero_info(link_said(cost.timed, trainer, runs))
        if self.fp16_rung:
            cost.take_half(*self.measure_half(trainer), fresh)
        if not self.state.compressor.passthrough:
            cost.take_compression(self.measure_compression(trainer), fresh)
        # A round's own work is timed later, where rounds could pay (`Rounds.switch`).
        self.rounds.time_work = lambda method: self.measure_round(trainer, method)

    def measure_link(self, trainer: "pl.Trainer") -> tuple[float, float]:
        """``(seconds a message, seconds a moved byte)`` of the compression group's all-reduce, the same on every rank
        (:meth:`LinkTimer.message_and_byte`). A subclass may return a model (tests)."""
        return self._link_timer(trainer).message_and_byte()

    def measure_half(self, trainer: "pl.Trainer") -> tuple[float, float]:
        """``(seconds a moved byte of an fp16 all-reduce, seconds the casts of a half step take)``, the same on every
        rank (:meth:`LinkTimer.half`). A subclass may return a model (tests)."""
        latency = self.cost.timed[0] if self.cost.timed is not None else 0.0
        return self._link_timer(trainer).half(self.state.cast, latency)

    def measure_compression(self, trainer: "pl.Trainer") -> float:
        """The seconds a compressed step's selection, encoding and decoding take at the ladder's mildest factor, the
        same on every rank (:meth:`LinkTimer.compression`). A subclass may return a model (tests)."""
        residual = self.state.error_feedback and not self.state.compressor.owns_feedback
        return self._link_timer(trainer).compression(self.state.compressor, self.ladder.cf_min, residual)

    def measure_round(self, trainer: "pl.Trainer", method: Compressor) -> float:
        """The seconds a round of local steps takes beyond its bytes, ``method`` its outer code, the same on every rank
        (:meth:`LinkTimer.round`). A subclass may return a model (tests)."""
        return self._link_timer(trainer).round(method, self.rounds.cf)

    def _link_timer(self, trainer: "pl.Trainer") -> LinkTimer:
        """The fit's timer of the compression group, its slowest-rank values reduced as every decision input is."""
        if self._timer is None:
            reduce_max = lambda values: self._all_reduce(trainer, values, dist.ReduceOp.MAX)  # noqa: E731
            self._timer = LinkTimer(trainer, self.state.process_group, reduce_max)
        return self._timer

    @override
    def _on_adaptive_optimizer(self) -> None:
        if self.hold.policy == "compress":
            super()._on_adaptive_optimizer()
        # Else said by the hold at the end of fit start, once the probes have told whether fp16 can be sent.

    @override
    def decide(self, state: CompressionState) -> Factors:
        probe_cfs = self.probe_cfs if not self.holding() and self._probing(state) else ()
        half = self.cf == HALF and self.fp16_rung
        return replace(super().decide(state), probe_cfs=probe_cfs, gain_of=self.probes.gain_of, half=half)

    def _probing(self, state: CompressionState) -> bool:
        """Whether the next step measures the gains: every step of the first window; then one step in the probes'
        spacing, fewer while probes change nothing, none while no factor could pay whatever it kept. Once Adam's
        moments move, the first step that sends them; none under a method of one factor."""
        probes = self.window.windows == 0 or (self.probes.due(self.window.steps) and self.gains_can_matter())
        if self.moments_moved():  # a method of one factor has no gain to measure
            probes = state.compressor.fixed_cf is None and (probes or state.step == state.carry.sends_from)
        return probes

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, *args: Any
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, *args)
        self.clock.begin_batch(self.state.step, batch, warn=self.window.steps == 0)

    def step_seconds(self, stats: StepStats) -> float:
        """This rank's time for the step that produced ``stats`` (forward, backward, communication, optimizer).

        A subclass may model it instead, e.g. to simulate a slower link in a test.
        """
        return self.clock.seconds()

    def compress_seconds(self, stats: StepStats) -> float:
        """This rank's time selecting and encoding in the step that produced ``stats`` (a subclass may model it)."""
        return stats.compress_s

    @override
    def observe(self, stats: StepStats, trainer: "pl.Trainer | None") -> None:
        reduce = self._reduce(trainer)
        if self.rounds.every:  # local steps: nothing is sent a step, no factor to choose; the first round measures
            left = self.budget.steps - self.state.step
            self.rounds.local_step(self.step_seconds(stats), self.state, self.cost, left, lambda v: _slowest(reduce, v))
            return
        probed = self._record(stats)
        self._after_step(reduce, probed)

    def _record(self, stats: StepStats) -> bool:
        """Take the step of ``stats`` in: the gains it probed, what it cost, and (unless it is a fit's first) its cost
        and gain in the tally of the factor sent. Returns whether it probed."""
        window, cost = self.window, self.cost
        window.steps += 1
        gains = stats.probe_gains()
        if gains:
            self.probes.take(gains, window.steps, cost.world_size, stats.variance_weight(cost.world_size))
        compressed = self.cf not in (DENSE, *self.rungs)
        cost.take_step(stats, self.cf, compressed)
        seconds = self.step_seconds(stats)
        if cost.first_step is None:
            self.clock.first_seconds = seconds
        if not self.clock.tallied():  # a fit's first step allocates, builds DDP's buckets, warms caches
            return bool(gains)
        # The sent factor's gain, measured on what the gains are of: the error-fed gradient (what was sent of it), or
        # the step's own gradient (the probes' smoothed value).
        smoothed = self.probes.gains
        gain = smoothed.get(self.cf, stats.gain) if self.probes.gain_of == "gradient" and compressed else stats.gain
        window.tally.setdefault(self.cf, Tally()).add(
            seconds=seconds, comm_seconds=stats.comm_s, compress_seconds=self.compress_seconds(stats),
            samples=self.clock.samples, gain=gain, moved=moved_in_step(stats, cost.world_size), probed=bool(gains),
        )  # fmt: skip
        return bool(gains)

    def _after_step(self, reduce: Reduce | None, probed: bool) -> None:
        """After a step (``probed``: it measured the gains): end the window when it is full, choose the next factor,
        space the probes, and say a change of regime. ``reduce`` is ``None`` without a trainer (one process)."""
        window, cost = self.window, self.cost
        probed = probed and window.windows > 0  # the first window probes every step: no back-off from those
        if cost.first_step is None and cost.link is None and cost.timed is not None:
            # The first window's choice needs a step's computation: the slowest rank's first step, alike on every rank.
            cost.first_step = (_slowest(reduce, self.clock.first_seconds), self.cf)
            # Local steps as soon as the fit's first step bounds a step's computation from above (its warm-up counted
            # in): where they pay with that bound, they pay with the computation the window would measure. Not after
            # a resumed run's first step: the uninterrupted run did not consider them there.
            if self.window.steps == 1:
                first_link = cost.first_step_link(self.rungs)
                self.rounds.switch(self.compression_state, cost, first_link, self.choose(), self.rungs, self.budget)
        if window.interval == "step" and window.advance():
            self._end_window(reduce)
        sent, self.cf = self.cf, self.choose()
        self.probes.space(self.cf != sent, probed)
        say_choice(cost, self.cf, sent, self.rungs, window.steps)

    def _reduce(self, trainer: "pl.Trainer | None") -> Reduce | None:
        """A reduction over the compression's ranks, which every rank must call alike; ``None`` without a trainer."""
        return None if trainer is None else lambda values, op: self._all_reduce(trainer, values, op)

    def _end_window(self, reduce: Reduce | None) -> None:
        """End the window: the throughputs and costs of the factors it sent, then what the search rule changes at a
        window's end, and whether it settles."""
        closed = self.window.close(reduce, self.cost.world_size)
        if closed is None:
            return
        self.cost.take_window(closed.compression, self.fp16_rung)
        self.rule.end_window(closed, self.ladder, self.probes.gains, self.cost, self.window.settled, self.omega)
        self.window.settle(self.omega)
        self.rounds.switch(self.compression_state, self.cost, self.cost.link, self.choose(), self.rungs, self.budget)

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.window.interval == "epoch" and self.window.advance():
            self._end_window(self._reduce(trainer))
            self.cf = self.choose()
            self.apply(self.state)

    def choose(self) -> float:
        """The factor to send next step: decided from values every rank holds identically."""
        state = self.compression_state
        method = state.compressor if state is not None else None
        held = self.hold.factor(self.holding(), self.moments_moved(), method, self.rungs, self.cost)
        return held if held is not None else self.rule.choose(self.decision())

    def decision(self) -> Decision:
        """What the search rule decides from: the parts' values, the rungs, the budget and the weighed gains."""
        return Decision(ladder=self.ladder, settled=self.window.settled, gains=self.probes.gains, cost=self.cost,
                        epsilon=self.epsilon, rungs=self.rungs, admits=self.within_budget,
                        progress=self.weighed_progress)  # fmt: skip

    def gains_can_matter(self) -> bool:
        """Whether some factor could beat dense if it kept all of the gradient (gain 1): if none can (compressing
        costs more time than its bytes save, as on a fast link), no gain changes the choice and the model search
        stops measuring them. True for the sequential search and before the step's cost is known."""
        return self.rule.gains_can_matter(self.cost, self.ladder, self.rungs)

    def within_budget(self, cf: float) -> bool:
        """Whether an entry sent at ``cf`` waits within the run's budget (:meth:`Budget.admits`)."""
        state = self.compression_state
        return self.budget.admits(state.compressor if state is not None else None, cf, self.grad_dtype, self.rungs)

    def kept(self, cf: float) -> float:
        """What a step at ``cf`` keeps of a dense step, from its smoothed gain (:func:`~.prediction.kept`)."""
        state = self.compression_state
        weight = self.probes.weight_of_variance if self.weigh_noise else 1.0
        return kept(self.probes.gains.get(cf, 0.0), state is None or state.compressor.biased, weight)

    def masking_weight(self, cf: float) -> float:
        """The share of dense momentum's step that momentum factor masking leaves a step sent at ``cf``
        (:func:`~.prediction.masking_weight`); 1 where nothing is masked or with ``weigh_masking`` off."""
        state = self.compression_state
        if state is None or not self.weigh_masking or cf in (DENSE, *self.rungs):
            return 1.0
        return masking_weight(state.compressor, state.carry.get(MomentumCorrection), cf, self.grad_dtype)

    def weighed_progress(self, cf: float) -> float:
        """The share of a dense step's progress a step at ``cf`` makes: ``kept(cf) ** gain_power x masking weight``."""
        return self.kept(cf) ** self.gain_power * self.masking_weight(cf)

    def predicted_throughput(self, cf: float, dense_bytes: float) -> float:
        """``Tc`` the link model predicts for ``cf``: samples a second x weighed gain (``nan`` before a window ends)."""
        return self.cost.world_size * self.clock.samples * progress_per_second(self.decision(), cf, dense_bytes)

    @override
    def metrics(self, stats: StepStats) -> dict[str, float]:
        metrics = super().metrics(stats)
        metrics["gravac/cf_min"] = self.ladder.cf_min
        metrics["gravac/probe_cf"] = self.ladder.candidate
        metrics["gravac/settled"] = self.window.settled if self.window.settled is not None else 0.0
        metrics["gravac/compression_throughput"] = self.window.throughput.get(self.state.cf, 0.0)
        return metrics

    @override
    def state_dict(self) -> dict[str, Any]:
        """The factor and the guard (the base class's), then each part's checkpointed fields by name. Lightning writes
        rank 0's: the partial window's times and samples (rank-local) feed a MAX and a sum over ranks, decided alike."""
        parts: tuple[Checkpointed, ...] = (self.ladder, self.probes, self.window, self.cost)
        checkpointed = {key: value for part in parts for key, value in part.state_dict().items()}
        rounds = self.rounds.state_dict() if self.rounds.every else {}  # a run without local steps saves as it did
        return {**super().state_dict(), **{key: checkpointed[key] for key in CHECKPOINT_ORDER}, **rounds}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in (self.ladder, self.probes, self.window, self.cost, self.rounds):
            part.load_state_dict(state_dict)
        super().load_state_dict(state_dict)

    def __repr__(self) -> str:
        ladder, probes, window = self.ladder, self.probes, self.window
        return (
            f"GraVAC(cf_min={ladder.cf_min:g}, cf_max={ladder.cf_max:g}, epsilon={self.epsilon}, "
            f"omega={self.omega}, window={window.length}, policy={ladder.policy!r}, search={self.search!r}, "
            f"probe_every={probes.probe_every}, first_window={window.first}, gain_of={probes.gain_of!r}, "
            f"gain_power={self.gain_power:.3g}, time_link={self.time_link}, adam={self.hold.policy!r}, "
            f"probe_backoff={probes.probe_backoff}, fp16_rung={self.fp16_rung}, weigh_masking={self.weigh_masking}, "
            f"weigh_noise={self.weigh_noise}, budget={self.budget.on})"
        )


def _slowest(reduce: Reduce | None, value: float) -> float:
    """The largest of every rank's ``value``, called on every rank alike; this rank's without a trainer (``None``)."""
    held = torch.tensor([value], dtype=torch.float64)
    return float((held if reduce is None else reduce(held, dist.ReduceOp.MAX))[0])
