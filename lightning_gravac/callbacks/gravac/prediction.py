"""What GraVAC's model search predicts of a step at each factor: the progress it makes a second, the best factor, and
what GraVAC says of its choice. Functions of the values a decision reads (:class:`Decision`), which every rank holds
alike, so every rank predicts alike."""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from lightning_utilities.core.rank_zero import rank_zero_info

from lightning_gravac.adaptations.momentum import MomentumCorrection, SGDMomentum, masking_retention
from lightning_gravac.callbacks.gravac.cost import DENSE, CostModel, regime, saves_enough
from lightning_gravac.callbacks.gravac.ladder import Ladder
from lightning_gravac.compressors.base import Compressor


@dataclass(frozen=True)
class Decision:
    """What a search rule decides the next factor from, the same on every rank.

    Attributes:
        ladder: the factors, and the sequential search's candidate.
        settled: the factor the sequential search settled on, else ``None``.
        gains: the smoothed gain of each probed factor.
        cost: the cost model of a step.
        epsilon: the gain a factor must keep to be sent.
        rungs: the factors sent whole in fp16 (``HALF`` when the rung is on), weighed besides dense and the ladder.
        admits: whether an entry sent at a factor waits within the run's budget.
        progress: the share of a dense step's progress a lossy step at a factor makes (:func:`kept`, weighed).
    """

    ladder: Ladder
    settled: float | None
    gains: dict[float, float]
    cost: CostModel
    epsilon: float
    rungs: tuple[float, ...]
    admits: Callable[[float], bool]
    progress: Callable[[float], float]


def kept(gain: float, biased: bool, variance_weight: float = 1.0) -> float:
    """What a step keeps of a dense step, from its ``gain``: the gain itself for a ``biased`` method (the energy it
    sends now, error feedback delaying the rest); for an unbiased one, whose gain is ``1 + w`` (``w`` the variance it
    adds, relative to a rank's gradient energy), ``1 / (1 + w x variance_weight)``, as that variance costs steps.

    ``variance_weight`` (``sum_i ||g_i||^2 / ||sum_i g_i||^2``, in ``[1/N, 1]``) is that variance against the
    averaged gradient's: an SGD step's progress goes as ``||G||^2 / (||G||^2 + noise)``; the code adds ``w`` times a
    rank's energy over ``N`` to the average's noise, which already holds the batches' own. Where that noise dominates
    the weight is 1 (each rank's energy is mostly its noise); where the ranks' gradients agree it is ``1/N``."""
    if not biased and gain > 1.0:
        return 1.0 / (1.0 + (gain - 1.0) * variance_weight)
    return min(gain, 1.0)


def masking_weight(method: Compressor, momentum: MomentumCorrection, cf: float, dtype: torch.dtype) -> float:
    """The share of dense momentum's step that momentum factor masking leaves a step of ``method`` sent at ``cf``
    (:func:`~lightning_gravac.adaptations.momentum.masking_retention` at the method's mean wait between two sends of an
    entry of ``dtype``), the least over the optimizer's momentum settings (``momentum``'s, or the method's own); 1
    where nothing is masked. Only from settings every rank holds alike."""
    wait = method.masked_wait(cf, dtype)
    if wait is None:
        return 1.0
    own = method.masked_momentum()  # DGC's, which it keeps itself
    settings = {SGDMomentum(own)} if own > 0 else momentum.masked_settings()
    retained = [masking_retention(wait, s.momentum, s.nesterov, method.random_sends) for s in settings]
    return min(retained, default=1.0)


def progress_per_second(d: Decision, cf: float, dense_bytes: float) -> float:
    """The progress of a step at ``cf`` (1 for dense and the rungs: fp16 keeps all but the rounding, which error
    feedback carries to the next step) over its predicted seconds: the same on every rank. ``nan`` before a window
    ends."""
    link = d.cost.link
    if link is None:
        return math.nan
    seconds = d.cost.seconds(link, cf, dense_bytes, d.rungs)
    progress = 1.0 if cf in (DENSE, *d.rungs) else d.progress(cf)
    return progress / seconds if seconds > 0 else math.inf


#: The most a fit's first step may be predicted to cost beyond the mildest factor's and still be sent dense, before a
#: step's computation is known: paid once a fit, it is below 2% of any run worth distributing (100 steps of 10 ms).
FIRST_STEP_EXTRA = 0.02


def first_window_choice(cost: CostModel, mildest: float, rungs: tuple[float, ...]) -> float:
    """Dense or ``mildest`` for a step of the first window, on the fit-start timing's link: before a step's
    computation is known, dense where its communication costs at most :data:`FIRST_STEP_EXTRA` more; then, with the
    rest of the step taken from the slowest rank's first step (``cost.first_step``: its seconds less the communication
    predicted for what it sent, and its compression as the fit-start timing measured it), ``mildest`` only where
    it saves :data:`MIN_SAVING` of a step."""
    link, dense_bytes = cost.timed_link(), cost.dense_bytes
    if link is None or mildest == DENSE or not dense_bytes:
        return mildest
    measured = cost.first_step_link(rungs)
    if measured is None:
        extra = cost.seconds(link, DENSE, dense_bytes, rungs) - cost.seconds(link, mildest, dense_bytes, rungs)
        return DENSE if extra <= FIRST_STEP_EXTRA else mildest
    dense, lossy = (cost.seconds(measured, cf, dense_bytes, rungs) for cf in (DENSE, mildest))
    return mildest if saves_enough(lossy, dense) else DENSE


def best_predicted(d: Decision) -> float:
    """The factor of highest predicted progress a second among dense, the rungs and the factors of the ladder whose
    gain reaches ``epsilon``, whose entries wait within the budget and which save at least :data:`MIN_SAVING` of a
    dense step."""
    link, dense_bytes = d.cost.link, d.cost.bytes_dense
    lossy = [*d.rungs] + [cf for cf in d.ladder.factors if d.gains.get(cf, 0.0) >= d.epsilon and d.admits(cf)]
    if link is not None:
        dense = d.cost.seconds(link, DENSE, dense_bytes, d.rungs)
        lossy = [cf for cf in lossy if saves_enough(d.cost.seconds(link, cf, dense_bytes, d.rungs), dense)]
    eligible = [DENSE, *lossy]
    # Ranked without the samples a step (N x this rank's batch, which a last batch can make differ between ranks):
    # every term left is the same on every rank, so is the choice.
    return max(eligible, key=lambda cf: (progress_per_second(d, cf, dense_bytes), -cf))


def say_choice(cost: CostModel, cf: float, previous: float | None, rungs: tuple[float, ...], steps: int) -> None:
    """Say on rank 0 what is sent (``cf``) and why: at fit start (``previous`` ``None``) and whenever the regime
    changes (dense, whole in fp16, compressed), with the link and the predicted seconds of a dense step and of this
    one; ``steps``: the steps so far."""
    if previous is not None and regime(previous, rungs) == regime(cf, rungs):
        return
    link, dense_bytes = cost.known_link(), cost.dense_bytes
    sending = {"dense": "dense (cf 1)", "fp16": "the whole gradient in fp16"}.get(
        regime(cf, rungs), f"compressed at cf {cf:g}"
    )
    when = "first steps" if previous is None else f"after step {steps}"
    if link is None or cost.timed is None or not dense_bytes:
        rank_zero_info(f"GraVAC: {when}: sending {sending}.")
        return
    why = (
        f"the link measured {8 / cost.timed[1] / 1e6 if cost.timed[1] > 0 else math.inf:.0f} Mbit/s, so a "
        f"dense step is predicted at {1e3 * cost.seconds(link, DENSE, dense_bytes, rungs):.1f} ms"
    )
    if cf != DENSE:
        why += f" and this one at {1e3 * cost.seconds(link, cf, dense_bytes, rungs):.1f} ms"
    if previous is None and cf != DENSE:
        why += " (the mildest factor, until a step has measured the computation)"
    rank_zero_info(f"GraVAC: {when}: sending {sending}: {why}.")
