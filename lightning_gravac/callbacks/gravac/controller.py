"""GraVAC: gradient-variance-aware adaptive compression (Tyagi & Swany, IEEE CLOUD 2023), the controller.

Its rules (``search.py``), the cost model of a step (``cost.py``) and the link probe (``probe.py``) live beside it.
"""

import math
import time
from typing import Any, Literal

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_info, rank_zero_warn
from pytorch_lightning.utilities.data import extract_batch_size
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_gravac._validation import choice, fraction, whole
from lightning_gravac.callbacks.controller import Controller
from lightning_gravac.callbacks.gravac.cost import DENSE, Link, Tally, fit_link, moved_bytes, regime
from lightning_gravac.callbacks.gravac.probe import PROBE_BYTES, LinkProbe
from lightning_gravac.callbacks.gravac.search import (
    DEFAULT_CF_MAX,
    DEFAULT_CF_MIN,
    SEARCH_DEFAULTS,
    SEARCHES,
    Interval,
    Policy,
    Search,
)
from lightning_gravac.callbacks.gravac.state import GraVACState, carried_attributes
from lightning_gravac.compressors.base import validate_cf
from lightning_gravac.feedback.momentum import SGDMomentum, masking_retention
from lightning_gravac.state import HALF, CompressionState, GainOf, StepStats, ring_share


def _gain_power(value: float) -> float:
    power = float(value)
    if not (math.isfinite(power) and power >= 0):
        raise ValueError(f"`gain_power` must be a finite number >= 0, got {value}.")
    return power


@carried_attributes
class GraVAC(Controller):
    """Adapt the compression factor to what compression loses (gain) and what the link costs (step time).

    **The default** (``GraVAC()``, which ``GraVACStrategy()`` installs) sends, each step, the factor of highest
    predicted progress a second among dense and a ladder of factors (``cf_min, x2, x4, x16, ...`` up to ``cf_max``):

    - the **link** is measured at fit start (all-reduces of growing size, the slowest rank's times): a cost a message
      and a cost a byte, so the first decision knows what a dense step costs without sending one;
    - the **rest of a step** and what compressing costs are measured on the steps sent, refitted every ``window``;
    - the **gains** ``sum ||C_cf(g)||^2 / sum ||g||^2`` of the step's own gradient at every factor are probed on one
      step in ``probe_every`` (backing off while they change nothing), smoothed by a bias-corrected EWMA;
    - a step at ``f`` makes :meth:`kept` ``(f) ** gain_power`` of a dense step's progress, times the momentum that
      masking leaves (:meth:`masking_weight`); factors whose entries would wait longer than the run
      (:meth:`within_budget`) are left out.

    Until the first window ends (3 steps) it sends the most aggressive admitted factor. Under Adam or AdamW it sends
    dense or whole in fp16, whichever the link makes faster, while Adam's second moment settles; then the strategy
    freezes it and sends each rank's first moment compressed (``adam``). It says what it
    sends and why at fit start and at every change between dense, fp16 and compressed. Every input of a decision
    crossed the network or was reduced over ranks, so every rank decides alike. Why each rule departs from the
    paper, and the measurements behind it: ``docs/algorithms.md``.

    **The paper's GraVAC** (Tyagi & Swany, IEEE CLOUD 2023) is ``GraVAC(search="sequential")``: the arguments left at
    ``None`` take the paper's values (error-fed gain, ``epsilon`` 0.7 as the gate, window 500, probes every step).
    Each step it sends a candidate factor if its gain reaches ``epsilon``, else ``cf_min`` if that does, else dense;
    each window it measures every sent factor's throughput ``samples / t_step x gain``, promotes the candidate when
    the gains agree within ``omega``, advances it (``policy``) and settles when two throughputs agree within
    ``omega``.

    Args:
        cf_min: least aggressive factor, where compression starts. ``None``: 10, or the size of the model's largest
            gradient if that is smaller.
        cf_max: most aggressive factor ever used. ``None``: 1000, or the size of the model's largest gradient if that
            is smaller (no tensor can be compressed further: at least one entry is always sent). A value passed
            explicitly is never changed: one the model cannot honour raises at setup.
        epsilon: minimum gain a factor must keep to be sent, in (0, 1]. ``None``: 0.02 (model), 0.7 (sequential).
        omega: relative tolerance for promotion and plateau, in (0, 1].
        window: steps (or epochs) between search decisions (the model search's refits of the step's cost).
            ``None``: 50 (model), 500 (sequential).
        policy: how the ladder (or the candidate) advances, ``"exponential"`` or ``"geometric"``.
        alpha: EWMA factor of the gains, in (0, 1]; ``None`` for the paper's ``N/100`` clamped to [0.02, 0.5].
        interval: unit of ``window``, ``"step"`` or ``"epoch"``.
        search: ``"model"`` (the default, above) or ``"sequential"`` (the paper).
        probe_every: after the first window, measure the probe factors' gains on one step in this many (1: every
            step). Steps without probes send at the chosen factor alone. The smoothing still runs per step: a probe
            after ``p`` steps weighs ``1 - (1 - alpha)^p``. ``None``: 25 (model), 1 (sequential).
        first_window: length of the first window (in ``interval`` units); ``None``: 3 (model; its first decision
            needs only the link's cost and a step's), ``window`` (sequential).
        gain_of: what the gains are measured on, ``"error_fed"`` (gradient plus residual) or ``"gradient"`` (the
            step's own gradient). ``None``: ``"gradient"`` for the model search unless the method keeps an
            accumulation of its own (DGC), else ``"error_fed"``.
        gain_power: the model search weighs a factor's progress as ``gain ** gain_power`` (1: the paper's
            throughput). ``None``: 1/3 (model), 1 (sequential).
        link_probe: time all-reduces at fit start to know the link before the first step (model search).
            ``None``: on for the model search.
        adam: what to do when the optimizer divides each coordinate by a running second moment (Adam, AdamW,
            RMSprop, Adagrad) and the method is lossy. Error-fed sparse and quantized gradients upset Adam's
            per-coordinate normalisation; a 16-bit cast does not, nor does compressing Adam's first moment once its
            second is frozen (``docs/optimizers.md``). ``"moment"`` (default): for ``torch.optim.Adam`` and ``AdamW``
            (as the strategy's ``momentum_correction`` allows), send the first tenth of the run as ``"fp16"`` does
            while the second moment settles, then each rank's first moment compressed with error feedback, the
            second frozen: at the method's factor or dense or fp16, whichever the cost model predicts faster (a method
            of one factor, such as the default's scaled signs), else by the search; other Adam-like optimizers as
            ``"fp16"``. ``"fp16"``: send each step dense or whole in fp16 (its rounding error-fed), whichever the cost
            model predicts faster from the link and the fp16 all-reduce measured at fit start and the steps sent since
            (model search, fp32 parameters, a method without an accumulation of its own; otherwise dense), and say so
            once. ``"dense"``: hold factor 1. ``"compress"``: search on the gradients as with SGD.
        probe_backoff: after the first window, each probe that leaves the choice as it was doubles the spacing of
            the probes, up to ``probe_every x probe_backoff`` steps; a change of choice brings it back to
            ``probe_every`` (1: no back-off). ``None``: 8 (model: probes between 25 and 200 steps apart), 1
            (sequential).
        fp16_rung: let the model search send a step whole in fp16 (``None``: off: it paid on no cell of the benchmark
            matrix, ``docs/algorithms.md``). When on, it is
            turned off at setup for 16-bit parameters (nothing to halve), for methods that keep an accumulation of
            their own (DGC) or have one factor (casts, sign methods), and for ``cf_min`` of 2 or less.
        weigh_masking: weigh each factor's progress by the momentum that momentum factor masking keeps at it (model
            search only).
        budget: leave out the factors whose entries would wait longer than the run's steps
            (``trainer.estimated_stepping_batches``), and make the most aggressive one it admits the ladder's last
            rung (model search only).

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
        adam: Literal["moment", "fp16", "dense", "compress"] = "moment",
        probe_backoff: int | None = None,
        fp16_rung: bool | None = None,
        weigh_masking: bool = True,
        budget: bool = True,
    ) -> None:
        # Which bounds are defaults, fitted to the model at setup (`fit_to_model`), and which the user chose.
        self._fitted = {"cf_min": cf_min is None, "cf_max": cf_max is None}
        cf_min = DEFAULT_CF_MIN if cf_min is None else validate_cf(cf_min, "cf_min")
        cf_max = DEFAULT_CF_MAX if cf_max is None else validate_cf(cf_max, "cf_max")
        if cf_min > cf_max:
            raise ValueError(f"`cf_min` ({cf_min:g}) must not exceed `cf_max` ({cf_max:g}).")
        super().__init__(cf=cf_min)
        self.search = choice(search, "search", tuple(SEARCHES))
        self._rule, defaults = SEARCHES[self.search], SEARCH_DEFAULTS[self.search]
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
        # The gradients' dtype is the largest trainable parameter's, set at setup (`masking_weight`).
        self.weigh_masking, self._grad_dtype = bool(weigh_masking), torch.float32
        # `budget_steps`: the fit's steps (`trainer.estimated_stepping_batches`, set at fit start; inf when unknown).
        self.budget, self.budget_steps = bool(budget) and self._rule.models_cost, math.inf
        if self.fp16_rung and not self._rule.models_cost:
            raise ValueError("`fp16_rung=True` needs `search='model'`: the sequential search has no cost model for it.")
        # The user's choice, which `fp16_rung` is derived from at each setup and fit; a ladder from 2 or less has the
        # factor already.
        self._rung_asked, self.fp16_rung = self.fp16_rung, self.fp16_rung and cf_min > HALF
        default_first = self._rule.first_window(self.window)
        self.first_window = default_first if first_window is None else whole(first_window, "first_window")
        self.cf_max, self.ladder = cf_max, self._ladder(cf_min, cf_max)

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
        self._probe_bytes, self._model_bytes = PROBE_BYTES[1], 0
        self._warm_up = False  # the next observed step is a fit's first: its time is not tallied
        self._world_size, self._batch_size, self._step_start, self.bytes_dense = 1, 1, 0.0, 0

    @override
    def fit_to_model(self, largest: int) -> None:
        """Fit the default bounds (those not passed) to the method's reach (:meth:`Compressor.factor_range`, once the
        strategy's method is known: QSGD's 2- to 8-bit codes), else 10 and 1000, capped at ``largest``, the size of
        the model's largest gradient. Said when they change."""
        reach = self._state.compressor.factor_range(self._grad_dtype) if self._state is not None else None
        cf_min, cf_max = reach if reach is not None else (DEFAULT_CF_MIN, DEFAULT_CF_MAX)
        cf_max = min(cf_max, float(largest)) if self._fitted["cf_max"] else self.cf_max
        cf_min = min(cf_min, cf_max) if self._fitted["cf_min"] else self.search_state.cf_min
        if (cf_min, cf_max) == (self.search_state.cf_min, self.cf_max):
            return
        self.search_state.cf_min, self.cf_max, self.ladder = cf_min, cf_max, self._ladder(cf_min, cf_max)
        self.search_state.candidate = min(max(self.search_state.candidate, cf_min), cf_max)
        if self.cf not in (DENSE, HALF):  # dense or fp16 (a resumed run's factor) stay what they are
            self.cf = min(max(self.cf, cf_min), cf_max)
        why = f"{self.state.compressor.name!r} sends from {reach[0]:.3g} to {reach[1]:.3g}" if reach else ""
        if largest in (cf_max, cf_min):
            why += ("; " if why else "") + f"the model's largest gradient has {largest} entries"
        rank_zero_info(f"GraVAC: factors {', '.join(f'{f:.3g}' for f in self.ladder)} ({why or 'the defaults'}).")

    def _ladder(self, cf_min: float, cf_max: float) -> tuple[float, ...]:
        factors, scale = [cf_min], 2.0
        while factors[-1] < cf_max:
            factors.append(min(cf_min * scale, cf_max))
            scale = self.next_scale(scale)
        return tuple(factors)

    def next_scale(self, scale: float) -> float:
        """The policy: exponential squares the scale (2, 4, 16, 256, ...), geometric doubles it."""
        return scale * scale if self.policy == "exponential" else 2 * scale

    @property
    def probe_cfs(self) -> tuple[float, ...]:
        """The factors whose gain the hook measures each step."""
        return self._rule.probe_cfs(self)

    @property
    @override
    def max_cf(self) -> tuple[str, float]:
        return "cf_max", self.cf_max

    @property
    def ewma_alpha(self) -> float:
        """The gains' smoothing factor in force."""
        return self.alpha if self.alpha is not None else max(0.02, min(0.5, self._world_size / 100))

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._world_size = trainer.world_size
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
        self._grad_dtype = max(trainable, key=lambda p: p.numel()).dtype if trainable else torch.float32
        self._check_rung(pl_module)

    def _check_rung(self, pl_module: "pl.LightningModule") -> None:
        """Turn the fp16 rung off where it cannot be sent: 16-bit parameters, a method with its own accumulation or
        one factor, a ladder from 2 or less (at setup, and again at fit start for layers built in configure_model).
        Turn it on for the hold of an Adam-like optimizer (``adam="fp16"``), where it is the only factor besides 1."""
        method = self.state.compressor
        fp32 = all(p.dtype == torch.float32 for p in pl_module.parameters() if p.requires_grad)
        held = self.adaptive_optimizer and self.adam in ("fp16", "moment") and self._rule.models_cost
        # Held for Adam, a method of one factor (the moments' scaled signs) leaves fp16 a choice of its own.
        own_state = method.owns_feedback or method.near_lossless or (method.fixed_cf is not None and not held)
        # From the user's choice, not from what the last fit derived: an Adam fit's rung does not outlive that fit.
        self.fp16_rung = (
            (self._rung_asked or held) and fp32 and not own_state and (held or self.search_state.cf_min > HALF)
        )

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
        if not self._rule.models_cost:
            self._hold_for_adam()
            return
        self._check_rung(pl_module)
        self._model_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
        fresh = self.search_state.steps == 0  # not a resumed run, whose next factor was decided before the checkpoint
        if self.budget:  # the same on every rank: the trainer's settings and the data's length
            self.budget_steps = float(trainer.estimated_stepping_batches)
            self._fit_ladder_to_budget()
        self._warm_up = True  # a resumed run's first step allocates and builds DDP's buckets again too
        if self.link_probe and trainer.world_size > 1:
            self.probed = self.measure_link(trainer)
            rank_zero_info(
                f"GraVAC: link measured at fit start: {self.probed[0] * 1e6:.0f} us a message, "
                f"{8 / self.probed[1] / 1e6 if self.probed[1] > 0 else math.inf:.0f} Mbit/s."
            )
            if self.fp16_rung:
                self.half_per_byte, cast_cost = self.measure_half(trainer)
                # A resumed run keeps its cost, measured since on the steps it sent in fp16, unless it has none (a
                # checkpoint of a run whose rung was off, or of a version that did not measure it).
                if fresh or self.search_state.cast_cost <= 0:
                    self.search_state.cast_cost = cast_cost
            if fresh:
                self.cf = self._choose()
                self._hand_over(self.state)
                self._say_choice(None)
        self._hold_for_adam()
        # The fp16 rung of an Adam fit is known from here on: a resumed run's next step may be a half one.
        self._hand_over(self.state)

    def _say_choice(self, previous: float | None) -> None:
        """Say on rank 0 what is sent and why: at fit start (``previous`` ``None``) and whenever the regime changes
        (dense, whole in fp16, compressed), with the link and the predicted seconds of a dense step and of this one."""
        if previous is not None and regime(previous, self.rungs) == regime(self.cf, self.rungs):
            return
        link = self.search_state.link if self.search_state.link is not None else self._probed_link()
        dense_bytes = self.bytes_dense or self._model_bytes
        sending = {"dense": "dense (cf 1)", "fp16": "the whole gradient in fp16"}.get(
            regime(self.cf, self.rungs), f"compressed at cf {self.cf:g}"
        )
        when = "first steps" if previous is None else f"after step {self.search_state.steps}"
        if link is None or self.probed is None or not dense_bytes:
            rank_zero_info(f"GraVAC: {when}: sending {sending}.")
            return
        why = (
            f"the link measured {8 / self.probed[1] / 1e6 if self.probed[1] > 0 else math.inf:.0f} Mbit/s, so a "
            f"dense step is predicted at {1e3 * self.predicted_seconds(link, DENSE, dense_bytes):.1f} ms"
        )
        if self.cf != DENSE:
            why += f" and this one at {1e3 * self.predicted_seconds(link, self.cf, dense_bytes):.1f} ms"
        if previous is None and self.cf != DENSE:
            why += " (until the first window has measured the gains, the most aggressive factor)"
        rank_zero_info(f"GraVAC: {when}: sending {sending}: {why}.")

    def _hold_for_adam(self) -> None:
        """Under an Adam-like optimizer held dense or fp16: the factor of the first step (a resumed run's too), and
        what the user gets, said once a fit."""
        if self.holds_for_adam:
            self.cf = self._choose()
            self._hand_over(self.state)
            self._say_hold()

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

    def _say_hold(self) -> None:
        """Say, on rank 0, what an Adam-like optimizer gets: dense or fp16 by the link, or dense and why."""
        if self.state.feedback.adam.frozen_from is not None:
            return  # its moments move after the warm-up: said by `_freeze_adam`
        if self.rungs and self.adam in ("fp16", "moment"):
            sending = "sending each step dense or whole in fp16, whichever the measured link makes faster"
        else:
            sending = f"sending dense (factor 1): {self._why_no_half()}"
        rank_zero_warn(
            f"GraVAC: the optimizer scales each coordinate by a running second moment (Adam-like), which lossy "
            f"{self.state.compressor.name!r} gradients upset: {sending}. `GraVAC(adam='compress')` compresses anyway."
        )

    def _why_no_half(self) -> str:
        """Why an Adam-like optimizer's hold cannot send fp16 (with :attr:`rungs` empty)."""
        if self.adam == "dense":
            return "asked with `adam='dense'`"
        if not self._rule.models_cost:
            return "the sequential search has no cost model to weigh fp16 against dense"
        if not self.fp16_rung:
            return (
                f"fp16 cannot be sent here (parameters not in fp32, or {self.state.compressor.name!r} keeps an "
                "accumulation of its own or sends one fixed factor)"
            )
        return "the link was not measured (one rank, or `link_probe=False`), so fp16 cannot be shown to pay"

    @override
    def apply(self, state: CompressionState) -> None:
        super().apply(state)
        if self.holds_for_adam:  # dense or fp16 (chosen by `_choose`): no gains to measure
            state.cf, state.probe_cfs = self.cf, ()
            state.half = self.cf == HALF and self.fp16_rung
            return
        # Every step of the first window; then one step in `probe_every` (the gains are smoothed anyway), so that a
        # settled or dense choice stops paying for the measurement on the other steps; fewer while probes change
        # nothing, none while no factor could pay whatever it kept.
        probing = self.search_state.windows == 0 or (
            self.search_state.steps % self.search_state.probe_interval == 0 and self.gains_can_matter()
        )
        if self.moments_moved():  # Adam's moments: the first step that sends them measures their gains
            fixed = state.compressor.fixed_cf is not None
            probing = not fixed and (probing or state.step == state.feedback.adam.frozen_from)
        state.probe_cfs = self.probe_cfs if probing else ()
        state.gain_of = self.search_state.gain_of
        state.half = self.cf == HALF and self.fp16_rung

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, *args: Any
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, *args)
        self._step_start = time.perf_counter()
        try:
            self._batch_size = extract_batch_size(batch)
        except (MisconfigurationException, RecursionError):
            # No tensor to count (or too deep a structure): the batch counts as one sample. Throughputs are then per
            # batch; the model search ranks progress per second without it, the sequential search compares factors
            # measured with the same count.
            if self._batch_size != 1 or self.search_state.steps == 0:
                rank_zero_warn("GraVAC: no batch size found in the batch; throughputs are reported per batch.")
            self._batch_size = 1

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
        self.search_state.steps += 1
        self.bytes_dense = stats.bytes_dense
        gains = stats.probe_gains()
        if gains:  # the EWMA decays per step: a probe after p steps without one weighs 1 - (1 - alpha)^p
            weight = 1 - (1 - self.ewma_alpha) ** (self.search_state.steps - self.search_state.last_probe)
            self.search_state.last_probe = self.search_state.steps
            for cf, gain in gains.items():
                self._rule.smooth(self, cf, gain, weight)
        self.search_state.buckets = max(1, stats.buckets)
        if self.cf not in (DENSE, *self.rungs) and stats.bytes_sent and stats.bytes_dense:
            # What a step sends beyond dense/cf: headers, at least one entry a tensor, rounding to whole entries.
            self.search_state.payload_fixed = max(0.0, stats.bytes_sent - stats.bytes_dense / self.cf)
        seconds = self.step_seconds(stats)
        if self._warm_up:  # a fit's first step allocates, builds DDP's buckets, warms caches: not a step's cost
            self._warm_up = False
            self._after_step(trainer, probed=bool(gains))
            return
        tally = self.search_state.tally.setdefault(self.cf, Tally())
        tally.steps += 1
        tally.samples += self._batch_size
        tally.seconds += seconds
        tally.comm_seconds += stats.comm_s
        compress_seconds = self.compress_seconds(stats)
        tally.compress_seconds += compress_seconds
        if not gains:
            tally.plain_steps += 1
            tally.plain_compress_seconds += compress_seconds
        # The sent factor's gain, measured on what the gains are of: the error-fed gradient (what was sent of it), or
        # the step's own gradient (the probes' smoothed value).
        fresh = self.search_state.gain_of == "gradient" and self.cf not in (DENSE, *self.rungs)
        tally.gain += self.search_state.gains.get(self.cf, stats.gain) if fresh else stats.gain
        tally.moved_bytes += self._moved(stats)
        self._after_step(trainer, probed=bool(gains))

    def _moved(self, stats: StepStats) -> float:
        """Bytes a rank moved in the step of ``stats``: ``(N-1)`` payloads for the buckets gathered, a ring
        all-reduce's ``2 (N-1)/N`` of what was sent for the others (dense buckets, and summable payloads: Random-K's,
        a half step's)."""
        n = self._world_size
        share = stats.gathered / stats.buckets if stats.buckets else 0.0
        return stats.bytes_sent * (share * (n - 1) + (1 - share) * ring_share(n))

    def _after_step(self, trainer: "pl.Trainer | None", probed: bool = False) -> None:
        probed = probed and self.search_state.windows > 0  # the first window probes every step: no back-off from those
        if self.interval == "step":
            self.search_state.progress += 1
            if self.search_state.progress >= self.window_length:
                self._end_window(trainer)
        sent, self.cf = self.cf, self._choose()
        self._back_off(changed=self.cf != sent, probed=probed)
        self._say_choice(sent)

    def _back_off(self, changed: bool, probed: bool) -> None:
        """Space the probes: a probe after the first window that leaves the choice as it was doubles the spacing (up
        to ``probe_every x probe_backoff`` steps); any change of choice brings it back to ``probe_every``."""
        if changed:
            self.search_state.probe_interval = self.probe_every
        elif probed:
            self.search_state.probe_interval = min(
                2 * self.search_state.probe_interval, self.probe_every * self.probe_backoff
            )

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.interval == "epoch":
            self.search_state.progress += 1
            if self.search_state.progress >= self.window_length:
                self._end_window(trainer)
                self.cf = self._choose()
                self._hand_over(self.state)

    @property
    def window_length(self) -> int:
        """Steps (or epochs) of the current window: ``first_window`` for the first, ``window`` after."""
        return self.first_window if self.search_state.windows == 0 else self.window

    def _choose(self) -> float:
        """The factor to send next step: decided from values every rank holds identically."""
        if self.holds_for_adam:
            return self._dense_or_half()
        if self.moments_moved() and self.state.compressor.fixed_cf is not None:
            return self._fastest_whole_or_fixed()
        return self._rule.choose(self)

    def _fastest_whole_or_fixed(self) -> float:
        """Adam's moments under a method of one factor (scaled signs): dense, fp16 or that factor, whichever the cost
        model predicts fastest; that factor while the link is unknown. Nothing to search: what a step keeps of the
        moment is carried by error feedback, and the second moment no longer sees it."""
        fixed = float(self.state.compressor.fixed_cf or DENSE)
        link = self.search_state.link if self.search_state.link is not None else self._probed_link()
        if link is None:
            return fixed
        dense_bytes = self.bytes_dense or self._model_bytes
        options = [DENSE, *self.rungs, fixed]
        return min(options, key=lambda cf: (self.predicted_seconds(link, cf, dense_bytes), cf))

    def _dense_or_half(self) -> float:
        """Under an Adam-like optimizer: fp16 if the rung can be sent and the cost model predicts it faster than
        dense (before the first window ends, from the fit-start probe alone: the rest of the step is the same for
        both), else dense. The same on every rank."""
        link = self.search_state.link if self.search_state.link is not None else self._probed_link()
        if self.adam == "dense" or not self.rungs or link is None:
            return DENSE
        dense_bytes = self.bytes_dense or self._model_bytes
        half = self.predicted_seconds(link, HALF, dense_bytes)
        return HALF if half < self.predicted_seconds(link, DENSE, dense_bytes) else DENSE

    def _end_window(self, trainer: "pl.Trainer | None") -> None:
        self.search_state.progress = 0
        if not self.search_state.tally:
            return
        factors = sorted(self.search_state.tally)
        local = torch.tensor(
            [[t.seconds, t.comm_seconds, t.compress_seconds, t.plain_compress_seconds]
             for t in (self.search_state.tally[f] for f in factors)],
            dtype=torch.float64,
        )  # fmt: skip
        samples = torch.tensor([float(self.search_state.tally[f].samples) for f in factors], dtype=torch.float64)
        # Step times are this rank's own: the slowest rank sets the pace, and every rank must see the same value. So
        # must the samples: a rank's batches may differ from another's (batching by tokens, an uneven last batch of
        # an iterable data set), and the sequential search settles on these throughputs.
        if trainer is not None:
            local = self._all_reduce(trainer, local, dist.ReduceOp.MAX)
            samples = self._all_reduce(trainer, samples)
        else:
            samples = samples * self._world_size
        slowest = local
        measured, compress, plain = {}, [0.0, 0], [0.0, 0]
        rows = zip(factors, slowest.tolist(), samples.tolist(), strict=True)
        for f, (seconds, comm_seconds, compress_s, plain_s), total in rows:
            tally = self.search_state.tally[f]
            self.search_state.throughput[f] = total / seconds * (tally.gain / tally.steps)
            measured[f] = (tally.steps, seconds, comm_seconds, tally.moved_bytes)
            if f == HALF and self.fp16_rung:  # the casts' cost, kept apart from the method's
                self.search_state.cast_cost = (
                    (plain_s / tally.plain_steps) if tally.plain_steps else compress_s / tally.steps
                )
            elif f != DENSE:
                compress = [compress[0] + compress_s, compress[1] + tally.steps]
                plain = [plain[0] + plain_s, plain[1] + tally.plain_steps]
        if plain[1] or compress[1]:  # what compressing costs a step: from steps without probes when there were any
            self.search_state.compress_cost = plain[0] / plain[1] if plain[1] else compress[0] / compress[1]
        self.search_state.tally.clear()
        self.search_state.windows += 1
        self._rule.end_window(self, measured, slowest.tolist(), factors)
        self._check_plateau()

    def fit_step_model(
        self, measured: dict[float, tuple[int, float, float, float]], slowest: list[list[float]], factors: list[float]
    ) -> Link | None:
        """The step's cost model from this window's steps: the link from the setup probe when it ran (else fitted to
        the measured communication times), the rest of the step as measured minus communication and compression."""
        steps = sum(m[0] for m in measured.values())
        if steps == 0:
            return None
        compress_total = sum(row[2] for row in slowest)
        if self.probed is None:
            link = fit_link(measured)
            if link is not None:
                link.other_seconds = max(0.0, link.other_seconds - compress_total / steps)
            return link
        link = self._probed_link()
        assert link is not None
        comm = sum(n * link.per_step + moved * link.seconds_per_byte for n, _, _, moved in measured.values())
        seconds = sum(m[1] for m in measured.values())
        link.other_seconds = max(0.0, (seconds - comm - compress_total) / steps)
        return link

    def _probed_link(self) -> Link | None:
        """The cost model of the fit-start probe (``None`` when it did not run): a message a bucket and its seconds a
        moved byte; the rest of the step 0, for the caller to set once measured."""
        if self.probed is None:
            return None
        latency, per_byte = self.probed
        return Link(0.0, per_byte, latency * self.search_state.buckets)

    def _check_plateau(self) -> None:
        ranked = sorted(self.search_state.throughput.items(), key=lambda item: item[1], reverse=True)
        if len(ranked) >= 2 and ranked[0][1] > 0 and (ranked[0][1] - ranked[1][1]) / ranked[0][1] <= self.omega:
            self.search_state.settled = min(ranked[0][0], ranked[1][0])  # the less aggressive of the two
        else:
            self.search_state.settled = None

    def predicted_throughput(self, cf: float, dense_bytes: float) -> float:
        """``Tc`` the link model predicts for ``cf``: samples a second x weighed gain (``nan`` before a window ends)."""
        return self._world_size * self._batch_size * self._progress_per_second(cf, dense_bytes)

    def _progress_per_second(self, cf: float, dense_bytes: float) -> float:
        """``gain(cf) ** gain_power`` over the predicted seconds of a step at ``cf``: the same on every rank."""
        if self.search_state.link is None:
            return math.nan
        seconds = self.predicted_seconds(self.search_state.link, cf, dense_bytes)
        # fp16 keeps all but the rounding, which error feedback carries to the next step.
        full = cf in (DENSE, *self.rungs)
        progress = 1.0 if full else self.kept(cf) ** self.gain_power * self.masking_weight(cf)
        return progress / seconds if seconds > 0 else math.inf

    def kept(self, cf: float) -> float:
        """What a step at ``cf`` keeps of a dense step, from its gain: the gain itself for a biased method (the energy
        it sends now, error feedback delaying the rest); for an unbiased one, whose gain is ``1 + w`` (``w`` the
        variance it adds, relative to the gradient's energy), ``1 / (1 + w)``, as that variance costs steps."""
        gain = self.search_state.gains.get(cf, 0.0)
        if self._state is not None and not self._state.compressor.biased and gain > 1.0:
            return 1.0 / gain
        return min(gain, 1.0)

    def _fit_ladder_to_budget(self) -> None:
        """Replace the rungs the budget leaves out by the most aggressive factor it admits (whole, at least
        ``cf_min``), so that the search can send the edge: a method's wait is proportional to its factor."""
        state = self._state
        per_cf = state.compressor.masked_wait(1.0, self._grad_dtype) if state is not None else None
        if per_cf is None or not math.isfinite(self.budget_steps):
            return
        kept = [cf for cf in self.ladder if self.within_budget(cf)]
        edge = float(math.floor(self.budget_steps / per_cf))
        if len(kept) == len(self.ladder):
            return
        left_out = [f"{cf:g}" for cf in self.ladder if cf not in kept]
        if edge >= self.search_state.cf_min and (not kept or edge > kept[-1]):
            kept.append(edge)
        self.ladder = tuple(kept)
        rank_zero_info(
            f"GraVAC: a run of {self.budget_steps:.0f} steps: cf {', '.join(left_out)} left out (an entry would wait "
            f"longer than the run to be sent); factors {', '.join(f'{f:g}' for f in self.ladder) or 'none'}."
        )

    def within_budget(self, cf: float) -> bool:
        """Whether an entry sent at ``cf`` waits no longer than the run's steps (:attr:`budget_steps`) on average; true
        for methods that send every entry each step (quantizers, casts, low rank). The same on every rank."""
        state = self._state
        if not self.budget or state is None or cf in (DENSE, *self.rungs):
            return True
        wait = state.compressor.masked_wait(cf, self._grad_dtype)
        return wait is None or wait <= self.budget_steps

    def masking_weight(self, cf: float) -> float:
        """The share of dense momentum's step that momentum factor masking leaves a step sent at ``cf``
        (:func:`~lightning_gravac.feedback.momentum.masking_retention` at the method's mean wait between two sends
        of an entry), the least over the optimizer's momentum settings; 1 where nothing is masked or with
        ``weigh_masking`` off. Only from settings every rank holds alike."""
        state = self._state
        if state is None or not self.weigh_masking or cf in (DENSE, *self.rungs):
            return 1.0
        method = state.compressor
        wait = method.masked_wait(cf, self._grad_dtype)
        if wait is None:
            return 1.0
        own = method.masked_momentum()  # DGC's, which it keeps itself
        settings = {SGDMomentum(own)} if own > 0 else state.feedback.momentum.masked_settings()
        kept = [masking_retention(wait, s.momentum, s.nesterov, method.random_sends) for s in settings]
        return min(kept, default=1.0)

    def predicted_seconds(self, link: Link, cf: float, dense_bytes: float) -> float:
        """A step's seconds at ``cf`` by the fitted model: the rest, compressing, a message a bucket, the bytes."""
        per_byte = link.seconds_per_byte
        if cf == DENSE:
            moved, extra = moved_bytes(dense_bytes, dense_bytes, self._world_size), 0.0
        elif cf in self.rungs:  # the whole gradient in fp16, all-reduced (summable): its cost a byte, and the casts
            moved, extra = ring_share(self._world_size) * dense_bytes / cf, self.search_state.cast_cost
            per_byte = self.half_per_byte if self.half_per_byte is not None else per_byte
        else:
            moved = moved_bytes(dense_bytes / cf + self.search_state.payload_fixed, dense_bytes, self._world_size)
            extra = self.search_state.compress_cost
        return link.other_seconds + link.per_step + moved * per_byte + extra

    def gains_can_matter(self) -> bool:
        """Whether some factor could beat dense if it kept all of the gradient (gain 1): if none can (compressing
        costs more time than its bytes save, as on a fast link), no gain changes the choice and the model search
        stops measuring them. True for the sequential search and before the step's cost is known."""
        return self._rule.gains_can_matter(self)

    def best_predicted(self) -> float:
        eligible = [DENSE, *self.rungs] + [
            cf for cf in self.ladder if self.search_state.gains.get(cf, 0.0) >= self.epsilon and self.within_budget(cf)
        ]
        # Ranked without the samples a step (N x this rank's batch, which a last batch can make differ between
        # ranks): every term left is the same on every rank, so is the choice.
        return max(eligible, key=lambda cf: (self._progress_per_second(cf, self.bytes_dense), -cf))

    @override
    def metrics(self, stats: StepStats) -> dict[str, float]:
        metrics = super().metrics(stats)
        metrics["gravac/cf_min"] = self.search_state.cf_min
        metrics["gravac/probe_cf"] = self.search_state.candidate
        metrics["gravac/settled"] = self.search_state.settled if self.search_state.settled is not None else 0.0
        metrics["gravac/compression_throughput"] = self.search_state.throughput.get(self.state.cf, 0.0)
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
