"""What GraVAC's model search predicts of a step at each factor: its seconds by the cost model, the progress it makes,
the best factor, and what GraVAC says of its choice.

Like the search rules, these hold no state: they read the controller's (its settings, what a fit measured, and its
carried :class:`GraVACState`), so every rank, holding the same values, predicts alike.
"""

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from lightning_utilities.core.rank_zero import rank_zero_info

from lightning_gravac.callbacks.gravac.cost import DENSE, Link, Measured, fit_step, moved_bytes, probed_link, regime
from lightning_gravac.callbacks.gravac.ladder import within_budget
from lightning_gravac.feedback.momentum import MomentumCorrection, SGDMomentum, masking_retention
from lightning_gravac.state import ring_share

if TYPE_CHECKING:
    from lightning_gravac.callbacks.gravac.controller import GraVAC


def predicted_seconds(c: "GraVAC", link: Link, cf: float, dense_bytes: float) -> float:
    """A step's seconds at ``cf`` by the fitted model: the rest, compressing, a message a bucket, the bytes."""
    s, per_byte = c.search_state, link.seconds_per_byte
    if cf == DENSE:
        moved, extra = moved_bytes(dense_bytes, dense_bytes, c.world_size), 0.0
    elif cf in c.rungs:  # the whole gradient in fp16, all-reduced (summable): its cost a byte, and the casts
        moved, extra = ring_share(c.world_size) * dense_bytes / cf, s.cast_cost
        per_byte = c.half_per_byte if c.half_per_byte is not None else per_byte
    else:
        moved = moved_bytes(dense_bytes / cf + s.payload_fixed, dense_bytes, c.world_size)
        extra = s.compress_cost
    return link.other_seconds + link.per_step + moved * per_byte + extra


def known_link(c: "GraVAC") -> Link | None:
    """The step's cost model fitted at the last window's end, else the fit-start probe's; ``None`` before both."""
    link = c.search_state.link
    return link if link is not None else probed_link(c.probed, c.search_state.buckets)


def seconds_by_factor(c: "GraVAC") -> Callable[[float], float] | None:
    """A step's predicted seconds by factor on the link known so far (:func:`known_link`), of the last step's dense
    bytes (else the trainable parameters'); ``None`` while the link is unknown."""
    link, dense_bytes = known_link(c), c.bytes_dense or c.model_bytes
    return None if link is None else lambda cf: predicted_seconds(c, link, cf, dense_bytes)


def fit_step_model(c: "GraVAC", measured: Measured, slowest: list[list[float]]) -> Link | None:
    """The step's cost model from this window's steps: the link from the setup probe when it ran (else fitted to the
    measured communication times), the rest of the step as measured minus communication and compression."""
    compress_seconds = sum(row[2] for row in slowest)
    return fit_step(measured, compress_seconds, probed_link(c.probed, c.search_state.buckets))


def kept(c: "GraVAC", cf: float) -> float:
    """What a step at ``cf`` keeps of a dense step, from its gain: the gain itself for a biased method (the energy it
    sends now, error feedback delaying the rest); for an unbiased one, whose gain is ``1 + w`` (``w`` the variance it
    adds, relative to the gradient's energy), ``1 / (1 + w)``, as that variance costs steps."""
    gain, state = c.search_state.gains.get(cf, 0.0), c.compression_state
    if state is not None and not state.compressor.biased and gain > 1.0:
        return 1.0 / gain
    return min(gain, 1.0)


def masking_weight(c: "GraVAC", cf: float) -> float:
    """The share of dense momentum's step that momentum factor masking leaves a step sent at ``cf``
    (:func:`~lightning_gravac.feedback.momentum.masking_retention` at the method's mean wait between two sends of
    an entry), the least over the optimizer's momentum settings; 1 where nothing is masked or with ``weigh_masking``
    off. Only from settings every rank holds alike."""
    state = c.compression_state
    if state is None or not c.weigh_masking or cf in (DENSE, *c.rungs):
        return 1.0
    method = state.compressor
    wait = method.masked_wait(cf, c.grad_dtype)
    if wait is None:
        return 1.0
    own = method.masked_momentum()  # DGC's, which it keeps itself
    settings = {SGDMomentum(own)} if own > 0 else state.feedback.get(MomentumCorrection).masked_settings()
    retained = [masking_retention(wait, s.momentum, s.nesterov, method.random_sends) for s in settings]
    return min(retained, default=1.0)


def progress_per_second(c: "GraVAC", cf: float, dense_bytes: float) -> float:
    """``kept(cf) ** gain_power`` (times the masking weight) over the predicted seconds of a step at ``cf``: the same
    on every rank. ``nan`` before a window ends."""
    link = c.search_state.link
    if link is None:
        return math.nan
    seconds = predicted_seconds(c, link, cf, dense_bytes)
    # fp16 keeps all but the rounding, which error feedback carries to the next step.
    full = cf in (DENSE, *c.rungs)
    progress = 1.0 if full else kept(c, cf) ** c.gain_power * masking_weight(c, cf)
    return progress / seconds if seconds > 0 else math.inf


def predicted_throughput(c: "GraVAC", cf: float, dense_bytes: float) -> float:
    """``Tc`` the link model predicts for ``cf``: samples a second x weighed gain (``nan`` before a window ends)."""
    return c.world_size * c.batch_size * progress_per_second(c, cf, dense_bytes)


#: The least share of a dense step a lossy step must be predicted to save to be sent: below it the saving is within
#: the spread of a step's time on a shared machine, and the step would spend accuracy for nothing measurable.
MIN_SAVING = 0.1


def saves_enough(seconds: float, dense_seconds: float) -> bool:
    """Whether a lossy step predicted at ``seconds`` saves at least :data:`MIN_SAVING` of a dense step's."""
    return seconds <= (1 - MIN_SAVING) * dense_seconds


#: The most a fit's first step may be predicted to cost beyond the mildest factor's and still be sent dense, before a
#: step's computation is known: paid once a fit, it is below 2% of any run worth distributing (100 steps of 10 ms).
FIRST_STEP_EXTRA = 0.02


def first_window_choice(c: "GraVAC", mildest: float) -> float:
    """Dense or ``mildest`` for a step of the first window, on the fit-start probe's link: before a step's
    computation is known, dense where its communication costs at most :data:`FIRST_STEP_EXTRA` more; then, with the
    rest of the step taken from the slowest rank's first step (``c.first_step``: its seconds less the communication
    predicted for what it sent, compression counted as computation, which leans towards dense), ``mildest`` only where
    it saves :data:`MIN_SAVING` of a step."""
    link, dense_bytes = probed_link(c.probed, c.search_state.buckets), c.bytes_dense or c.model_bytes
    if link is None or mildest == DENSE or not dense_bytes:
        return mildest
    if c.first_step is None:
        extra = predicted_seconds(c, link, DENSE, dense_bytes) - predicted_seconds(c, link, mildest, dense_bytes)
        return DENSE if extra <= FIRST_STEP_EXTRA else mildest
    seconds, sent = c.first_step
    link.other_seconds = max(0.0, seconds - predicted_seconds(c, link, sent, dense_bytes))
    dense, lossy = (predicted_seconds(c, link, cf, dense_bytes) for cf in (DENSE, mildest))
    return mildest if saves_enough(lossy, dense) else DENSE


def best_predicted(c: "GraVAC") -> float:
    """The factor of highest predicted progress a second among dense, the rungs and the factors of the ladder whose
    gain reaches ``epsilon``, whose entries wait within the budget and which save at least :data:`MIN_SAVING` of a
    dense step."""
    gains, link, dense_bytes = c.search_state.gains, c.search_state.link, c.bytes_dense
    lossy = [*c.rungs] + [cf for cf in c.ladder if gains.get(cf, 0.0) >= c.epsilon and within_budget(c, cf)]
    if link is not None:
        dense = predicted_seconds(c, link, DENSE, dense_bytes)
        lossy = [cf for cf in lossy if saves_enough(predicted_seconds(c, link, cf, dense_bytes), dense)]
    eligible = [DENSE, *lossy]
    # Ranked without the samples a step (N x this rank's batch, which a last batch can make differ between ranks):
    # every term left is the same on every rank, so is the choice.
    return max(eligible, key=lambda cf: (progress_per_second(c, cf, c.bytes_dense), -cf))


def say_choice(c: "GraVAC", previous: float | None) -> None:
    """Say on rank 0 what is sent and why: at fit start (``previous`` ``None``) and whenever the regime changes (dense,
    whole in fp16, compressed), with the link and the predicted seconds of a dense step and of this one."""
    if previous is not None and regime(previous, c.rungs) == regime(c.cf, c.rungs):
        return
    link, dense_bytes = known_link(c), c.bytes_dense or c.model_bytes
    sending = {"dense": "dense (cf 1)", "fp16": "the whole gradient in fp16"}.get(
        regime(c.cf, c.rungs), f"compressed at cf {c.cf:g}"
    )
    when = "first steps" if previous is None else f"after step {c.search_state.steps}"
    if link is None or c.probed is None or not dense_bytes:
        rank_zero_info(f"GraVAC: {when}: sending {sending}.")
        return
    why = (
        f"the link measured {8 / c.probed[1] / 1e6 if c.probed[1] > 0 else math.inf:.0f} Mbit/s, so a "
        f"dense step is predicted at {1e3 * predicted_seconds(c, link, DENSE, dense_bytes):.1f} ms"
    )
    if c.cf != DENSE:
        why += f" and this one at {1e3 * predicted_seconds(c, link, c.cf, dense_bytes):.1f} ms"
    if previous is None and c.cf != DENSE:
        why += " (the mildest factor, until a step has measured the computation)"
    rank_zero_info(f"GraVAC: {when}: sending {sending}: {why}.")
