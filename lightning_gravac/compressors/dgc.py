"""Deep Gradient Compression (Lin et al., ICLR 2018)."""

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_gravac.compressors import kernels
from lightning_gravac.compressors.base import Payload, register_compressor, sparse_k, sq_norm
from lightning_gravac.compressors.select import Blocks, exact_topk, fill_to_k, margin_rank, sample, seeded_generator
from lightning_gravac.compressors.sparse import Sparsifier
from lightning_gravac.staged import Staged

#: Warm-up densities: each epoch keeps a quarter as much (75%, 93.75%, 98.4%, 99.6%, 99.9% sparsity).
_WARMUP_BASE = 0.25


@register_compressor
class DGC(Sparsifier):
    """Top-k of an accumulated, momentum-corrected gradient, with a sampled threshold.

    Per tensor: clip the gradient to ``clip_norm / sqrt(N)`` (local clipping), accumulate momentum
    ``u = m u + g`` and velocity ``v = v + u`` (momentum correction), send the ``k`` largest ``|v|`` and zero ``v``
    and ``u`` there (momentum factor masking). The threshold comes from a ``sample_ratio`` sample of ``|v|``, set so
    that a little more than ``k`` entries are expected to pass, and the exact top ``k`` among those that pass is
    sent. Short of ``k``, the threshold is lowered to just below the ``k``-th largest block peak (up to 3 rounds),
    and the payload is filled to exactly ``k``. During the first ``warmup_epochs`` epochs
    the density is at least ``0.25 ** (epoch + 1)`` (75%, 93.75%, ... sparsity).

    A tensor sent dense (factor 1, :meth:`deliver_`) carries the momentum and the accumulation: with ``a`` its clipped
    gradient, ``u = m u + a`` and ``v + u`` is sent; then ``v`` is 0 and ``u`` stays (nothing was delayed, so nothing
    is masked). A run of dense steps is heavy-ball momentum ``m``, as ``SGD(momentum=m)`` under stock DDP; weight
    decay, which the optimizer applies, stays outside the momentum on every step.

    DGC keeps its own residual (``v``), so the strategy's error feedback stays off, and its momentum correction
    replaces the optimizer's momentum: use ``SGD(momentum=0)`` (checked at setup) or ``momentum_correction=False``.
    State is committed only after a step is known finite on every rank, and is saved in checkpoints for every rank.

    Args:
        momentum: momentum ``m`` of the correction; use the value the optimizer would have used.
        momentum_correction: accumulate momentum in the compressor (on by default).
        clip_norm: local clipping norm before ``/ sqrt(N)``; ``None`` turns clipping off.
        momentum_masking: zero the momentum where entries were sent (on by default).
        warmup_epochs: epochs of the density warm-up; 0 turns it off.
        sample_ratio: share of the entries sampled to estimate the threshold.
        seed: seed of the sampling (per rank it need not agree: payload sizes are fixed by ``k``).
    """

    name = "dgc"
    owns_feedback = True

    def __init__(
        self,
        momentum: float = 0.9,
        momentum_correction: bool = True,
        clip_norm: float | None = 5.0,
        momentum_masking: bool = True,
        warmup_epochs: int = 4,
        sample_ratio: float = 0.01,
        seed: int = 0,
    ) -> None:
        if not 0 <= momentum < 1:
            raise ValueError(f"`momentum` must be in [0, 1), got {momentum!r}.")
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"`clip_norm` must be positive or None, got {clip_norm!r}.")
        if not 0 < sample_ratio <= 1:
            raise ValueError(f"`sample_ratio` must be in (0, 1], got {sample_ratio!r}.")
        if warmup_epochs < 0:
            raise ValueError(f"`warmup_epochs` must be >= 0, got {warmup_epochs!r}.")
        self.momentum, self.momentum_correction, self.clip_norm = momentum, momentum_correction, clip_norm
        self.momentum_masking, self.warmup_epochs, self.sample_ratio, self.seed = (
            momentum_masking,
            warmup_epochs,
            sample_ratio,
            seed,
        )
        self.epoch = 0
        self.world_size = 1
        # Momentum and velocity by key (fp32, flat), each step's new ones pending until committed (v None: a dense
        # step sent it all); the buffers a commit frees are reused (no gradient-sized allocation a step).
        self._u, self._v = Staged(), Staged()

    def setup(self, world_size: int, rank: int = 0) -> None:
        self.world_size = world_size

    def on_epoch_start(self, epoch: int) -> None:
        self.epoch = epoch

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.momentum_correction:
            return
        for group in optimizer.param_groups:
            if group.get("momentum", 0) or group.get("betas", (0,))[0]:
                raise ValueError(
                    f"DGC's momentum correction applies momentum (momentum={self.momentum}) in the compressor; the "
                    f"optimizer {type(optimizer).__name__} applies momentum as well, twice in all. Use an optimizer "
                    "without momentum (SGD(momentum=0)) or DGC(momentum_correction=False)."
                )

    def _accumulate(
        self, tensor: Tensor, key: str, recycle: bool = True
    ) -> tuple[Tensor | None, Tensor, Tensor | None, Tensor | None]:
        """The new momentum and velocity of ``key`` (fp32, flat) in fresh buffers, with the block peaks of ``|v|``
        and ``||v||^2`` where the compiled kernel computed them in the same pass (else ``None``); the stored state
        is untouched.

        With ``recycle`` the buffers are the ones a previous :meth:`commit` freed (no allocation a step); a pure probe
        allocates its own.
        """
        g = tensor.reshape(-1)
        scale = None
        if self.clip_norm is not None:
            norm = torch.linalg.vector_norm(g, dtype=torch.float32)
            scale = torch.clamp(self.clip_norm / math.sqrt(self.world_size) / (norm + 1e-12), max=1.0)
        # a = scale g, u = m u + a, v = v + u, evaluated in that order (the paper's arithmetic); m u + a is one
        # fused multiply-add, as torch's add with alpha computes it and as the compiled kernel does.
        v_old = self._v.kept.get(key)
        u_old = self._u.kept.get(key) if self.momentum_correction else None
        u = self._u.take(key, g, torch.float32, recycle) if self.momentum_correction else None
        v = self._v.take(key, g, torch.float32, recycle)
        if kernels.usable(g) and all(
            kernels.usable(t) and t.numel() == g.numel() for t in (u_old, v_old) if t is not None
        ):
            factor = 1.0 if scale is None else float(scale)
            peak, sq = kernels.accumulate(g, factor, u_old, self.momentum, u, v_old, v)
            return u, v, peak, torch.tensor(sq, dtype=torch.float64)
        fresh = v if u is None else u
        a = g if scale is None else torch.mul(g, scale, out=fresh)
        if u_old is not None:
            torch.add(a, u_old, alpha=self.momentum, out=fresh)
        elif a is not fresh:
            fresh.copy_(a)
        if u is None:
            return None, fresh if v_old is None else fresh.add_(v_old), None, None
        return u, v.copy_(u) if v_old is None else torch.add(v_old, u, out=v), None, None

    def masked_momentum(self) -> float:
        return self.momentum if self.momentum_correction and self.momentum_masking else 0.0

    def _k(self, numel: int, cf: float, dtype: torch.dtype) -> int:
        k = sparse_k(numel, cf, dtype)
        if self.epoch < self.warmup_epochs:
            k = max(k, math.ceil(numel * _WARMUP_BASE ** (self.epoch + 1)))
        return min(k, numel)

    def _select(self, v: Tensor, k: int, key: str, step: int, peak: Tensor | None = None) -> Tensor:
        """Exactly ``k`` indices of large ``|v|``: sampled threshold, refined, filled to ``k``."""
        n = v.numel()
        samples = math.ceil(self.sample_ratio * n)
        if k * 20 >= n or samples < 64:  # small or dense: the exact top-k costs no more than sampling
            return torch.topk(v.abs(), k, sorted=False).indices
        generator = seeded_generator(self.seed, step, key)
        drawn = sample(v, samples, generator).abs_()
        # A little more than k are expected to pass (margin_rank): falling short costs another scan, a few extra
        # candidates cost a slightly larger top-k among them.
        rank = min(drawn.numel(), margin_rank(drawn.numel(), k, n))
        threshold = float(torch.topk(drawn, rank, sorted=False).values.min())
        out = self.scratch.like(v)
        blocks = Blocks(v, signed=False, peak=peak)  # each threshold tried looks at the peaks and the hot blocks
        candidates, threshold = blocks.above_lowering(threshold, k, out)
        if candidates.numel() >= k or threshold <= 0:  # enough (the exact top k among them), or every non-zero
            return fill_to_k(v, candidates, k)
        return blocks.topk(k, out, generator)  # too few even so: exact top-k

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        return self.compress_and_probe(tensor, cf, (), key=key, step=step)[0]

    def compress_and_probe(
        self, tensor: Tensor, cf: float, probe_cfs: Sequence[float], *, key: str = "", step: int = 0
    ) -> tuple[Payload, Tensor]:
        u, v, peak, basis = self._accumulate(tensor, key)
        k = self._k(v.numel(), cf, tensor.dtype)
        indices = self._select(v, k, key, step, peak)
        values = v.index_select(0, indices).to(tensor.dtype)
        probes = self._probe_v(v, probe_cfs, tensor.dtype, key, step)
        basis = sq_norm(v) if basis is None else basis
        payload = Payload((values, indices.to(torch.int32)), tensor.shape, tensor.dtype, basis=basis)
        v.index_fill_(0, indices, 0)  # what was sent leaves the accumulation
        if u is not None and self.momentum_masking:
            u.index_fill_(0, indices, 0)
        self._stage(key, u, v)
        return payload, probes

    def _probe_v(self, v: Tensor, cfs: Sequence[float], dtype: torch.dtype, key: str, step: int) -> Tensor:
        # Approximate nesting: the norm of the exact top-k of |v| at each factor, from one sorted selection.
        if not cfs:
            return torch.zeros(0, dtype=torch.float64, device=v.device)
        ks = [self._k(v.numel(), cf, dtype) for cf in cfs]
        top = exact_topk(v, max(ks), self.scratch.like(v), seeded_generator(self.seed, step, key))
        prefix = v.index_select(0, top).double().square().sort(descending=True).values.cumsum(0)
        return prefix[torch.tensor(ks, device=prefix.device) - 1]

    def probe(self, tensor: Tensor, cfs: Sequence[float], *, key: str = "", step: int = 0) -> Tensor:
        _, v, _, _ = self._accumulate(tensor, key, recycle=False)
        return self._probe_v(v, cfs, tensor.dtype, key, step)

    def deliver_(
        self, units: Sequence[tuple[str, Tensor]], probe_cfs: Sequence[float] = (), *, step: int = 0
    ) -> dict[str, Tensor]:
        """Each tensor becomes ``v + u`` in place, ``u = m u + a`` from its clipped gradient ``a`` as on a compressed
        step (without momentum correction ``v + a``); the pending state keeps ``u`` and empties ``v``: a dense step
        delivers everything accumulated."""
        delivered = {}
        for key, tensor in units:
            u, v, _, _ = self._accumulate(tensor, key)
            delivered[key] = self._probe_v(v, probe_cfs, tensor.dtype, key, step)
            tensor.copy_(v.view(tensor.shape))
            self._v.release(key, v)  # everything accumulated is sent: the buffer holds nothing to keep
            self._stage(key, u, None)
        return delivered

    def _stage(self, key: str, u: Tensor | None, v: Tensor | None) -> None:
        """The step's new momentum (``None``: none kept, without momentum correction) and velocity (``None``: all of
        it sent) of ``key``, until committed."""
        if u is not None:
            self._u.stage(key, u)
        self._v.stage(key, v)

    def commit(self, keys: Sequence[str]) -> None:
        self._v.commit(keys)
        self._u.commit(keys)

    def discard(self, keys: Sequence[str]) -> None:
        self._v.discard(keys)
        self._u.discard(keys)

    def reset(self) -> None:
        self._u.clear()
        self._v.clear()

    def rescale_(self, factor: float) -> None:
        # u (momentum) and v (the accumulation) are sums of gradients, in the units the gradients carried.
        self._u.scale_(factor)
        self._v.scale_(factor)

    def state_dict(self) -> dict[str, object]:
        return {**{f"u/{k}": t.detach().clone() for k, t in self._u.kept.items()},
                **{f"v/{k}": t.detach().clone() for k, t in self._v.kept.items()}}  # fmt: skip

    def load_state_dict(self, state: dict[str, object]) -> None:
        tensors = {k: t for k, t in state.items() if isinstance(t, Tensor)}
        self._u.load({k[2:]: t for k, t in tensors.items() if k.startswith("u/")})
        self._v.load({k[2:]: t for k, t in tensors.items() if k.startswith("v/")})

    def __repr__(self) -> str:
        return (
            f"DGC(momentum={self.momentum}, momentum_correction={self.momentum_correction}, "
            f"clip_norm={self.clip_norm}, warmup_epochs={self.warmup_epochs})"
        )
