"""GraVAC: gradient-variance-aware adaptive compression (Tyagi & Swany, IEEE CLOUD 2023), the controller (its parts
are beside it: the package's docstring lists them)."""

import math
import time
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_warn
from pytorch_lightning.utilities.data import extract_batch_size
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_gravac._validation import choice, fraction, whole
from lightning_gravac.callbacks.controller import Controller
from lightning_gravac.callbacks.gravac.hold import AdamPolicy, check_rung, held_factor, hold_warning
from lightning_gravac.callbacks.gravac.ladder import (
    DEFAULT_CF_MAX,
    DEFAULT_CF_MIN,
    Policy,
    fit_bounds,
    fit_to_budget,
    ladder,
)
from lightning_gravac.callbacks.gravac.prediction import say_choice
from lightning_gravac.callbacks.gravac.probe import PROBE_BYTES, LinkProbe, probe_at_fit_start
from lightning_gravac.callbacks.gravac.search import SEARCH_DEFAULTS, SEARCHES, Interval, Search
from lightning_gravac.callbacks.gravac.state import GraVACState, carried_attributes
from lightning_gravac.callbacks.gravac.window import Reduce, after_step, end_window, probing, record_step
from lightning_gravac.compressors.base import validate_cf
from lightning_gravac.state import HALF, CompressionState, GainOf, StepStats


def _gain_power(value: float) -> float:
    power = float(value)
    if not (math.isfinite(power) and power >= 0):
        raise ValueError(f"`gain_power` must be a finite number >= 0, got {value}.")
    return power


@carried_attributes
class GraVAC(Controller):
    """Adapt the compression factor to what compression loses (gain) and what the link costs (step time).

    Each step it sends the factor of highest predicted progress a second among dense and a ladder of factors
    (``cf_min, x2, x4, x16, ...`` up to ``cf_max``), from the link measured at fit start, the steps sent and the gains
    the hook probes. Under Adam or AdamW it sends dense or fp16 while Adam's second moment settles, then Adam's first
    moment compressed. Every rank decides alike. ``GraVAC(search="sequential")`` is the paper's GraVAC (Tyagi & Swany,
    IEEE CLOUD 2023). The rules, and why they depart from the paper: ``docs/algorithms.md``.

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
        link_probe: measure the link at fit start, before the first step. ``None``: on for the model search.
        adam: under an optimizer that divides each coordinate by a running second moment (Adam, AdamW, RMSprop,
            Adagrad) and a lossy method: ``"moment"`` holds the first tenth of an Adam or AdamW run as ``"fp16"`` does,
            then sends each rank's first moment compressed, the second frozen; ``"fp16"`` sends each step dense or
            whole in fp16, whichever the cost model predicts faster; ``"dense"`` holds factor 1; ``"compress"``
            searches on the gradients as with SGD.
        probe_backoff: each probe after the first window that leaves the choice as it was doubles the probes'
            spacing, up to ``probe_every x probe_backoff`` steps. ``None``: 8 (model), 1 (sequential).
        fp16_rung: let the model search send a step whole in fp16 (turned off at setup where it cannot be sent).
            ``None``: off.
        weigh_masking: weigh each factor's progress by the momentum that momentum factor masking keeps at it.
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
        link_probe: bool | None = None,
        adam: AdamPolicy = "moment",
        probe_backoff: int | None = None,
        fp16_rung: bool | None = None,
        weigh_masking: bool = True,
        budget: bool = True,
    ) -> None:
        #: Which bounds are defaults, fitted to the model at setup (:meth:`fit_to_model`), and which the user chose.
        self.default_bounds = {"cf_min": cf_min is None, "cf_max": cf_max is None}
        cf_min = DEFAULT_CF_MIN if cf_min is None else validate_cf(cf_min, "cf_min")
        cf_max = DEFAULT_CF_MAX if cf_max is None else validate_cf(cf_max, "cf_max")
        if cf_min > cf_max:
            raise ValueError(f"`cf_min` ({cf_min:g}) must not exceed `cf_max` ({cf_max:g}).")
        super().__init__(cf=cf_min)
        self.search = choice(search, "search", tuple(SEARCHES))
        #: The decision rule of ``search`` (:class:`SearchRule`).
        self.rule, defaults = SEARCHES[self.search], SEARCH_DEFAULTS[self.search]
        self.window = whole(defaults["window"] if window is None else window, "window")
        self.epsilon = fraction(defaults["epsilon"] if epsilon is None else epsilon, "epsilon")
        self.omega = fraction(omega, "omega")
        self.alpha = None if alpha is None else fraction(alpha, "alpha")
        self.policy = choice(policy, "policy", ("exponential", "geometric"))
        self.interval = choice(interval, "interval", ("step", "epoch"))
        self.probe_every = whole(defaults["probe_every"] if probe_every is None else probe_every, "probe_every")
        # Left to the default, it is settled at setup: DGC has no gain of the gradient alone.
        self._gain_of_default = gain_of is None
        gain_basis: GainOf = choice(defaults["gain_of"] if gain_of is None else gain_of, "gain_of",
                                    ("error_fed", "gradient"))  # fmt: skip
        self.gain_power = _gain_power(defaults["gain_power"] if gain_power is None else gain_power)
        self.link_probe = bool(defaults["link_probe"] if link_probe is None else link_probe)
        self.adam = choice(adam, "adam", ("moment", "fp16", "dense", "compress"))
        self.probe_backoff = whole(defaults["probe_backoff"] if probe_backoff is None else probe_backoff,
                                   "probe_backoff")  # fmt: skip
        #: Whether the model search may send a step whole in fp16 (decided at setup: fp32 gradients, a method whose
        #: residual the hook keeps, ``cf_min`` above 2).
        self.fp16_rung = bool(defaults["fp16_rung"] if fp16_rung is None else fp16_rung)
        #: The gradients' dtype: the largest trainable parameter's, set at setup (what an entry's wait is counted in).
        self.weigh_masking, self.grad_dtype = bool(weigh_masking), torch.float32
        # `budget_steps`: the fit's steps (`trainer.estimated_stepping_batches`, set at fit start; inf when unknown).
        self.budget, self.budget_steps = bool(budget) and self.rule.models_cost, math.inf
        if self.fp16_rung and not self.rule.models_cost:
            raise ValueError("`fp16_rung=True` needs `search='model'`: the sequential search has no cost model for it.")
        # The user's choice, which `fp16_rung` is derived from at each setup and fit; a ladder from 2 or less has the
        # factor already.
        self.fp16_rung_asked, self.fp16_rung = self.fp16_rung, self.fp16_rung and cf_min > HALF
        default_first = self.rule.first_window(self.window)
        self.first_window = default_first if first_window is None else whole(first_window, "first_window")
        self.cf_max, self.ladder = cf_max, ladder(cf_min, cf_max, self.policy)
        #: What the run carries in its checkpoint: the search, identical on every rank, and the current window.
        self.search_state = GraVACState(cf_min=cf_min, candidate=min(cf_min * 2.0, cf_max),
                                        probe_interval=self.probe_every, gain_of=gain_basis)  # fmt: skip

        # What a fit measures, not carried in checkpoints.
        #: The setup probe's ``(seconds a message, seconds a moved byte)``, identical on every rank; None: not run.
        self.probed: tuple[float, float] | None = None
        #: Seconds a moved byte of an fp16 all-reduce (probed at fit start with the link); None: the rung is unknown.
        self.half_per_byte: float | None = None
        # The largest all-reduce the link probe timed; the trainable parameters' bytes (a dense step's before one is
        # measured), set at fit start.
        self._probe_bytes, self.model_bytes = PROBE_BYTES[1], 0
        #: Whether the next observed step is a fit's first, whose time is not tallied (set at fit start).
        self.warm_up = False
        #: The slowest rank's seconds of a fit's first step and the factor it sent, which the first window decides
        #: from (model search on a probed link; ``None`` before it), and this rank's seconds of it.
        self.first_step: tuple[float, float] | None = None
        self.first_step_local = 0.0
        #: The ranks (set at setup), this rank's samples in the step under way, and the last step's dense bytes.
        self.world_size, self.batch_size, self._step_start, self.bytes_dense = 1, 1, 0.0, 0

    @override
    def fit_to_model(self, largest: int) -> None:
        """Fit the default bounds to the method and the model's largest gradient (:func:`~.ladder.fit_bounds`)."""
        fit_bounds(self, largest)

    @property
    def probe_cfs(self) -> tuple[float, ...]:
        """The factors whose gain the hook measures each step."""
        return self.rule.probe_cfs(self)

    @property
    @override
    def max_cf(self) -> tuple[str, float]:
        return "cf_max", self.cf_max

    @property
    def ewma_alpha(self) -> float:
        """The gains' smoothing factor in force."""
        return self.alpha if self.alpha is not None else max(0.02, min(0.5, self.world_size / 100))

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self.world_size = trainer.world_size
        super().setup(trainer, pl_module, stage)
        method = self.state.compressor
        if self._gain_of_default and method.owns_feedback:  # it selects from its own accumulation, not the gradient
            self.search_state.gain_of = "error_fed"
        if self.search_state.gain_of == "gradient" and method.owns_feedback:
            raise ValueError(
                f"`gain_of='gradient'` measures what a factor keeps of the step's own gradient, but {method.name!r} "
                "selects from an accumulation of its own, not from the gradient. Use `gain_of='error_fed'`."
            )
        trainable = [p for p in pl_module.parameters() if p.requires_grad]
        self.grad_dtype = max(trainable, key=lambda p: p.numel()).dtype if trainable else torch.float32
        check_rung(self, pl_module)

    @property
    def holds_for_adam(self) -> bool:
        """Whether the optimizer is Adam-like, the method lossy, and this controller sends dense or fp16 for it: all
        the run, or the warm-up before Adam's moments move (``adam="moment"``)."""
        return self.adaptive_optimizer and self.adam != "compress" and not self.moments_moved()

    @property
    @override
    def moves_adam(self) -> bool:
        return self.adam == "moment"

    @property
    def rungs(self) -> tuple[float, ...]:
        """The factors the model search weighs besides dense and the ladder: ``HALF`` (fp16) when on."""
        return (HALF,) if self.fp16_rung and self.half_per_byte is not None else ()

    @override
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_fit_start(trainer, pl_module)
        if not self.rule.models_cost:
            self._hold_for_adam()
            return
        check_rung(self, pl_module)
        self.model_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
        fresh = self.search_state.steps == 0  # not a resumed run, whose next factor was decided before the checkpoint
        if self.budget:  # the same on every rank: the trainer's settings and the data's length
            self.budget_steps = float(trainer.estimated_stepping_batches)
            fit_to_budget(self)
        self.warm_up = True  # a resumed run's first step allocates and builds DDP's buckets again too
        self.first_step = None
        if self.link_probe and trainer.world_size > 1:
            probe_at_fit_start(self, trainer, fresh)
            if fresh:
                self.cf = self.choose()
                self._hand_over(self.state)
                say_choice(self, None)
        self._hold_for_adam()
        # The fp16 rung of an Adam fit is known from here on: a resumed run's next step may be a half one.
        self._hand_over(self.state)

    def _hold_for_adam(self) -> None:
        """Under an Adam-like optimizer held dense or fp16: the factor of the first step (a resumed run's too), and
        what the user gets, said once a fit (unless Adam's moments move after the warm-up: said by the base class)."""
        if self.holds_for_adam:
            self.cf = self.choose()
            self._hand_over(self.state)
            if self.state.feedback.sends_from is None:
                rank_zero_warn(hold_warning(self))

    def measure_link(self, trainer: "pl.Trainer") -> tuple[float, float]:
        """``(seconds a message, seconds a moved byte)`` of the compression group's all-reduce, the same on every rank
        (:meth:`LinkProbe.message_and_byte`). A subclass may return a model (tests)."""
        probe = self._link_probe(trainer)
        measured = probe.message_and_byte()
        self._probe_bytes = probe.largest
        return measured

    def measure_half(self, trainer: "pl.Trainer") -> tuple[float, float]:
        """``(seconds a moved byte of an fp16 all-reduce, seconds the casts of a half step take)``, the same on every
        rank (:meth:`LinkProbe.half`). A subclass may return a model (tests)."""
        latency = self.probed[0] if self.probed is not None else 0.0
        return self._link_probe(trainer).half(self.state.cast, latency, self._probe_bytes)

    def _link_probe(self, trainer: "pl.Trainer") -> LinkProbe:
        """A probe of the compression group, its slowest-rank values reduced as every decision input is."""
        return LinkProbe(
            trainer, self.state.process_group, lambda values: self._all_reduce(trainer, values, dist.ReduceOp.MAX)
        )

    @override
    def _on_adaptive_optimizer(self) -> None:
        if self.adam == "compress":
            super()._on_adaptive_optimizer()
        # Else said by `_hold_for_adam` at the end of fit start, once the probes have told whether fp16 can be sent.

    @override
    def apply(self, state: CompressionState) -> None:
        super().apply(state)
        if self.holds_for_adam:  # dense or fp16 (chosen by `choose`): no gains to measure
            state.cf, state.probe_cfs = self.cf, ()
            state.half = self.cf == HALF and self.fp16_rung
            return
        state.probe_cfs = self.probe_cfs if probing(self, state) else ()
        state.gain_of = self.search_state.gain_of
        state.half = self.cf == HALF and self.fp16_rung

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, *args: Any
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, *args)
        self._step_start = time.perf_counter()
        try:
            self.batch_size = extract_batch_size(batch)
        except (MisconfigurationException, RecursionError):
            # No tensor to count (or too deep a structure): the batch counts as one sample. Throughputs are then per
            # batch; the model search ranks progress per second without it, the sequential search compares factors
            # measured with the same count.
            if self.batch_size != 1 or self.search_state.steps == 0:
                rank_zero_warn("GraVAC: no batch size found in the batch; throughputs are reported per batch.")
            self.batch_size = 1

    def step_seconds(self, stats: StepStats) -> float:
        """This rank's time for the step that produced ``stats`` (forward, backward, communication, optimizer).

        A subclass may model it instead, e.g. to simulate a slower link in a test.
        """
        return time.perf_counter() - self._step_start

    def compress_seconds(self, stats: StepStats) -> float:
        """This rank's time selecting and encoding in the step that produced ``stats`` (a subclass may model it)."""
        return stats.compress_s

    @override
    def observe(self, stats: StepStats, trainer: "pl.Trainer | None") -> None:
        probed = record_step(self, stats)
        after_step(self, self._reduce(trainer), probed)

    def _reduce(self, trainer: "pl.Trainer | None") -> Reduce | None:
        """A reduction over the compression's ranks, which every rank must call alike; ``None`` without a trainer."""
        return None if trainer is None else lambda values, op: self._all_reduce(trainer, values, op)

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.interval == "epoch":
            self.search_state.progress += 1
            if self.search_state.progress >= self.window_length:
                end_window(self, self._reduce(trainer))
                self.cf = self.choose()
                self._hand_over(self.state)

    @property
    def window_length(self) -> int:
        """Steps (or epochs) of the current window: ``first_window`` for the first, ``window`` after."""
        return self.first_window if self.search_state.windows == 0 else self.window

    def choose(self) -> float:
        """The factor to send next step: decided from values every rank holds identically."""
        held = held_factor(self)
        return held if held is not None else self.rule.choose(self)

    def gains_can_matter(self) -> bool:
        """Whether some factor could beat dense if it kept all of the gradient (gain 1): if none can (compressing
        costs more time than its bytes save, as on a fast link), no gain changes the choice and the model search
        stops measuring them. True for the sequential search and before the step's cost is known."""
        return self.rule.gains_can_matter(self)

    @override
    def metrics(self, stats: StepStats) -> dict[str, float]:
        s = self.search_state
        metrics = super().metrics(stats)
        metrics["gravac/cf_min"] = s.cf_min
        metrics["gravac/probe_cf"] = s.candidate
        metrics["gravac/settled"] = s.settled if s.settled is not None else 0.0
        metrics["gravac/compression_throughput"] = s.throughput.get(self.state.cf, 0.0)
        return metrics

    @override
    def state_dict(self) -> dict[str, Any]:
        """The factor and the guard (the base class's), then :attr:`search_state`, each field under its name.

        Lightning writes rank 0's callback state, so on resume every rank gets rank 0's partial-window step times
        and sample counts: the only rank-local values here, which at the window's end feed a MAX (the times) and a
        sum (the samples) over ranks, so every rank still decides alike (the resumed window counts rank 0's samples
        for every rank).
        """
        return {**super().state_dict(), **self.search_state.checkpoint()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        s = self.search_state
        fresh = GraVACState(cf_min=s.cf_min, candidate=s.candidate, probe_interval=self.probe_every, gain_of=s.gain_of)
        self.search_state = GraVACState.from_checkpoint(state_dict, fresh)
        super().load_state_dict(state_dict)

    def __repr__(self) -> str:
        return (
            f"GraVAC(cf_min={self.search_state.cf_min:g}, cf_max={self.cf_max:g}, epsilon={self.epsilon}, "
            f"omega={self.omega}, window={self.window}, policy={self.policy!r}, search={self.search!r}, "
            f"probe_every={self.probe_every}, first_window={self.first_window}, gain_of={self.search_state.gain_of!r}, "
            f"gain_power={self.gain_power:.3g}, link_probe={self.link_probe}, adam={self.adam!r}, "
            f"probe_backoff={self.probe_backoff}, fp16_rung={self.fp16_rung}, weigh_masking={self.weigh_masking}, "
            f"budget={self.budget})"
        )
