"""PowerSGD: low-rank gradients by one step of power iteration (Vogels et al., NeurIPS 2019).

Each weight's gradient matrix ``M`` (``[rows, rest]``) crosses the network as two factors, in two rounds:

1. ``P = M Q``, with ``Q`` the matrix's previous all-reduced right factor (its warm start, the same on every rank).
2. All-reduce ``P`` (with the bucket's tensors sent dense).
3. Orthonormalize the summed ``P``; ``Q = M^T P``. With error feedback, ``M - P Q^T`` is what this rank keeps.
4. All-reduce ``Q`` (with the statistics header).
5. The summed ``Q`` is the next warm start; the average gradient is ``P Q^T / N``.

Steps 1, 3 and 5 are :class:`PowerSGD`'s bucket :class:`_Factors`; the communicator of methods of several rounds runs
steps 2 and 4.
"""

import math
from collections.abc import Sequence

import torch
from torch import Tensor

# torch's own orthogonalization: Gram-Schmidt with an epsilon for all-zero columns (vanishing gradients), QR where
# that is faster. Private API; should it move, `torch.linalg.qr` is the drop-in.
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize
from typing_extensions import override

from lightning_gravac.compressors import kernels
from lightning_gravac.compressors.base import Compressor, Pattern, Payload, register_compressor, sq_norm
from lightning_gravac.compressors.rounds import MultiRound, Part, Rounds
from lightning_gravac.compressors.select import seeded_generator


def as_matrix(tensor: Tensor) -> Tensor:
    """The fp32 ``[rows, rest]`` view of a gradient (a copy only if it is not fp32)."""
    return tensor.reshape(tensor.shape[0], -1).float()


def right_factor(matrix: Tensor, p: Tensor) -> Tensor:
    """``Q = M^T P``: by the compiled kernel where it applies (:func:`kernels.skinny_mtp`: M read once, by rows),
    else computed as ``(P^T M)^T`` (contiguous): BLAS runs the transposed product of a wide matrix with a few columns
    as a slow matrix-vector loop; the same sums. Rank 1 stays with BLAS (its matrix-vector product is as fast)."""
    if p.dim() == 2 and p.shape[1] > 1 and kernels.skinny_usable(matrix, p, transposed=True):
        return kernels.skinny_mtp(matrix, p)
    return (p.T @ matrix).T.contiguous()


def left_factor(matrix: Tensor, q: Tensor) -> Tensor:
    """``P = M Q``: by the compiled kernel where it applies (:func:`kernels.skinny_mq`), else torch's matmul."""
    if kernels.skinny_usable(matrix, q):
        return kernels.skinny_mq(matrix, q)
    return matrix @ q


def _product_kernel_applies(matrix: Tensor, p: Tensor, q: Tensor) -> bool:
    """Whether :func:`kernels.skinny_add_pqt_` takes ``matrix`` with ``P`` and ``Q``: both factors of one rank (else
    torch's product raises, as it should), each matching the matrix."""
    same_rank = p.dim() == 2 and q.dim() == 2 and p.shape[1] == q.shape[1]
    return same_rank and kernels.skinny_usable(matrix, q) and kernels.skinny_usable(matrix, p, transposed=True)


def add_product_(matrix: Tensor, p: Tensor, q: Tensor, alpha: float) -> None:
    """``matrix += alpha P Q^T`` in place: by the compiled kernel where it applies (:func:`kernels.skinny_add_pqt_`),
    else torch's ``addmm_``."""
    if _product_kernel_applies(matrix, p, q):
        kernels.skinny_add_pqt_(matrix, p, q, alpha)
    else:
        matrix.addmm_(p, q.T, alpha=alpha)


def average_product_(matrix: Tensor, p: Tensor, q: Tensor, ranks: int) -> None:
    """``matrix = P Q^T / ranks`` (the hook's average of the summed factors), ``matrix``'s contents not read: by the
    compiled kernel where it applies (one pass), else ``torch.mm`` then ``div_``."""
    if _product_kernel_applies(matrix, p, q):
        kernels.skinny_add_pqt_(matrix, p, q, 1.0, divisor=float(ranks))
    else:
        torch.mm(p, q.T, out=matrix).div_(ranks)


@register_compressor
class PowerSGD(Compressor, MultiRound):
    """Rank-``r`` approximation ``P Q^T`` of each weight's gradient matrix ``M`` (``[rows, rest]``), warm-started Q.

    Two all-reduces a bucket, the module's steps, which :class:`~lightning_gravac.GraVACStrategy`'s hook runs for
    this method. Error feedback (on by default) keeps ``M - P Q_own^T``, the part of this rank's gradient outside
    the shared subspace. 1-D tensors (biases, norms) are sent dense. Factors travel in fp32.

    The rank follows ``cf``: the whole number nearest (by ratio) to ``rows * rest / (cf (rows + rest))``, at least 1
    and at most ``min(rows, rest)``; ``rank`` fixes it instead (full rank reproduces the gradient, at more bytes
    than dense). Used alone, :meth:`compress` is the single-rank version of the same steps.

    Args:
        rank: a fixed rank; ``None`` derives it from ``cf``.
        epsilon: added to column norms in the orthogonalization (all-zero columns).
        seed: seed of the initial ``Q`` (shared by all ranks).
    """

    name = "powersgd"
    layerwise = True
    communication = Pattern.ROUNDS

    def __init__(self, rank: int | None = None, epsilon: float = 1e-8, seed: int = 0) -> None:
        if rank is not None and rank < 1:
            raise ValueError(f"`rank` must be >= 1 or None, got {rank!r}.")
        self.rank, self.epsilon, self.seed = rank, epsilon, seed
        self._q: dict[str, Tensor] = {}
        self._pending: dict[str, Tensor] = {}

    @override
    def takes(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` is compressed (2-D or more); the rest is sent dense."""
        return tensor.dim() >= 2

    @override
    def rounds(self, parts: Sequence[Part], residual: bool) -> Rounds:
        return _Factors(self, parts, residual)

    def rank_for(self, shape: torch.Size, cf: float) -> int:
        """The rank used for a tensor of ``shape`` at factor ``cf``."""
        rows, rest = shape[0], shape.numel() // shape[0]
        if self.rank is not None:
            rank = self.rank
        else:  # the whole rank nearest the exact one by ratio, i.e. the achievable factor nearest cf
            exact = rows * rest / (cf * (rows + rest))
            low = max(1, math.floor(exact))
            rank = low if exact * exact <= low * (low + 1) else low + 1
        return max(1, min(rank, rows, rest))

    def project(self, matrix: Tensor, rank: int, key: str) -> Tensor:
        """``P = M Q`` with this tensor's warm-started ``Q`` (a seeded random one at first or on a rank change)."""
        q = self._q.get(key)
        if q is None or q.shape != (matrix.shape[1], rank):
            generator = seeded_generator(self.seed, 0, key)
            q = torch.randn(matrix.shape[1], rank, generator=generator).to(matrix.device)
        return left_factor(matrix, q)

    def orthonormalize_(self, p: Tensor) -> Tensor:
        """Orthonormalize the columns of ``p`` in place and return it."""
        _orthogonalize(p.unsqueeze(0), self.epsilon)
        return p

    def keep(self, key: str, q: Tensor) -> None:
        """Hold the all-reduced ``Q`` of ``key`` as its next warm start, until :meth:`commit`."""
        self._pending[key] = q

    @override
    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        if not self.takes(tensor):
            return Payload((tensor.reshape(-1).clone(),), tensor.shape, tensor.dtype)
        matrix = as_matrix(tensor)
        p = self.orthonormalize_(self.project(matrix, self.rank_for(tensor.shape, cf), key))
        return Payload((p, right_factor(matrix, p)), tensor.shape, tensor.dtype)

    @override
    def decompress(self, payload: Payload) -> Tensor:
        if len(payload.wire) == 1:
            return payload.wire[0].view(payload.shape).clone()
        p, q = payload.wire
        return (p @ q.T).to(payload.dtype).view(payload.shape)

    @override
    def residual_(self, tensor: Tensor, payload: Payload) -> None:
        matrix = as_matrix(tensor)
        if len(payload.wire) == 2 and matrix.data_ptr() == tensor.data_ptr() and matrix.is_contiguous():
            p, q = payload.wire
            add_product_(matrix, p, q, -1.0)  # M - P Q^T in place: no decoded matrix allocated
        else:
            super().residual_(tensor, payload)

    @override
    def aggregate_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        if len(stacked.wire) == 1 or out.dtype != torch.float32 or not out.is_contiguous():
            super().aggregate_(out, stacked, scale)
            return
        matrix = out.view(stacked.shape[0], -1)
        for p, q in zip(*stacked.wire, strict=True):  # rank order, each P Q^T added in place
            add_product_(matrix, p, q, scale)

    @override
    def sent_sq_norm(self, payload: Payload) -> Tensor:
        if len(payload.wire) == 1:
            return sq_norm(payload.wire[0])
        if payload.dtype != torch.float32:  # decoded with one more rounding, which the closed form does not see
            return super().sent_sq_norm(payload)
        # ||P Q^T||^2 = sum((P^T P) * (Q^T Q)): two rank x rank products instead of the decoded matrix.
        p, q = (w.double() for w in payload.wire)
        return ((p.T @ p) * (q.T @ q)).sum()

    @override
    def probe(self, tensor: Tensor, cfs: Sequence[float], *, key: str = "", step: int = 0) -> Tensor:
        if not self.takes(tensor):
            return sq_norm(tensor).expand(len(cfs)).clone()
        # ||P Q^T||^2 = ||Q||^2 for orthonormal P: no decoding needed.
        norms = [sq_norm(self.compress(tensor, cf, key=key).wire[1]) for cf in cfs]
        return torch.stack(norms) if norms else torch.zeros(0, dtype=torch.float64, device=tensor.device)

    @override
    def commit(self, keys: Sequence[str]) -> None:
        for key in keys:
            if key in self._pending:
                self._q[key] = self._pending.pop(key)

    @override
    def discard(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._pending.pop(key, None)

    @override
    def state_dict(self) -> dict[str, object]:
        return {f"q/{k}": q.detach().clone() for k, q in self._q.items()}

    @override
    def load_state_dict(self, state: dict[str, object]) -> None:
        self._q = {k[2:]: t.clone() for k, t in state.items() if isinstance(t, Tensor) and k.startswith("q/")}

    @override
    def __repr__(self) -> str:
        return f"PowerSGD(rank={self.rank}, epsilon={self.epsilon}, seed={self.seed})"


class _Factors(Rounds):
    """One bucket's rounds under :class:`PowerSGD`: steps 1, 3 and 5 of the module's, on each part's matrix."""

    count = 2

    def __init__(self, method: PowerSGD, parts: Sequence[Part], residual: bool) -> None:
        self.method, self.parts, self.residual = method, list(parts), residual
        self.matrices = [as_matrix(part.tensor) for part in self.parts]  # views of the inputs for fp32
        self.ps: list[Tensor] = []
        self.qs: list[Tensor] = []

    @override
    def payload(self, round: int, summed: Tensor | None) -> list[Tensor]:
        method = self.method
        if summed is None:
            # Step 1: P = M Q, Q the warm start of each matrix.
            ranks = [method.rank_for(part.tensor.shape, part.cf) for part in self.parts]
            self.ps = [
                method.project(m, r, part.key) for part, m, r in zip(self.parts, self.matrices, ranks, strict=True)
            ]
            return self.ps
        # Step 2, the communicator's: P all-reduced, `summed` begins with it.
        # Step 3: the summed P orthonormalized (in place: step 5 reads it), Q = M^T P, and what this rank keeps.
        offset = 0
        for part, p, m in zip(self.parts, self.ps, self.matrices, strict=True):
            p.copy_(summed[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
            method.orthonormalize_(p)
            q = right_factor(m, p)
            if self.residual:
                add_product_(m, p, q, -1.0)  # M - P Q^T in place: no decoded matrix allocated
                if m.data_ptr() != part.tensor.data_ptr():  # not fp32: `m` was a copy
                    part.tensor.copy_(m.view_as(part.tensor))
            self.qs.append(q)
        return self.qs  # step 4, the communicator's: Q all-reduced with the header

    @override
    def sent_sq_norms(self) -> list[Tensor]:
        return [q.double().square().sum() for q in self.qs]  # ||P Q^T|| = ||Q|| for orthonormal P

    @override
    def finish(self, summed: Tensor, ranks: int) -> None:
        # Step 5: the summed Q is the next warm start; P Q^T / N is the average gradient.
        offset = 0
        for part, p, q in zip(self.parts, self.ps, self.qs, strict=True):
            q_sum = summed[offset : offset + q.numel()].view_as(q)
            offset += q.numel()
            self.method.keep(part.key, q_sum)
            if part.out.dtype == p.dtype and part.out.is_contiguous():  # P Q^T written into the bucket, then averaged
                average_product_(part.out.view(p.shape[0], -1), p, q_sum, ranks)
            else:
                part.out.copy_((p @ q_sum.T).div_(ranks).view_as(part.out))
