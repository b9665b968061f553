"""PowerSGD: low-rank gradients by one step of power iteration (Vogels et al., NeurIPS 2019)."""

import math
from collections.abc import Sequence

import torch
from torch import Tensor

# torch's own orthogonalization: Gram-Schmidt with an epsilon for all-zero columns (vanishing gradients), QR where
# that is faster. Private API; should it move, `torch.linalg.qr` is the drop-in.
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

from lightning_gravac.compressors import kernels
from lightning_gravac.compressors.base import Communication, Compressor, Payload, register_compressor, sq_norm
from lightning_gravac.compressors.select import seeded_generator


def as_matrix(tensor: Tensor) -> Tensor:
    """The fp32 ``[rows, rest]`` view of a gradient (a copy only if it is not fp32)."""
    return tensor.reshape(tensor.shape[0], -1).float()


def right_factor(matrix: Tensor, p: Tensor) -> Tensor:
    """``Q = M^T P``: by the compiled kernel where it applies (:func:`kernels.skinny_mtp`: M read once, by rows;
    5000 x 5000 at rank 2 6 ms, at 25 11 ms, against BLAS's 12 and 23 on this project's CPU), else computed as
    ``(P^T M)^T`` (contiguous): BLAS runs the transposed product of a wide matrix with a few columns as a slow
    matrix-vector loop (25M entries at rank 2: 90 ms against 11 ms); the same sums. Rank 1 stays with BLAS (its
    matrix-vector product is as fast)."""
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
class PowerSGD(Compressor):
    """Rank-``r`` approximation ``P Q^T`` of each weight's gradient matrix ``M`` (``[rows, rest]``), warm-started Q.

    With ``Q`` this tensor's previous (all-reduced) right factor, identical on every rank: ``P = M Q``, all-reduce
    ``P``, orthonormalize it, ``Q = M^T P``, all-reduce ``Q``; the average gradient is ``P Q^T / N``. Two all-reduces
    a bucket (``P`` with the bucket's dense parts, then ``Q`` with the statistics header), which
    :class:`~lightning_gravac.GraVACStrategy`'s hook runs for this method. Error feedback (on by default) keeps
    ``M - P Q_local^T``, the part of this rank's gradient outside the shared subspace. 1-D tensors (biases, norms)
    are sent dense. Factors travel in fp32.

    The rank follows ``cf``: the whole number nearest (by ratio) to ``rows * rest / (cf (rows + rest))``, at least 1
    and at most ``min(rows, rest)``; ``rank`` fixes it instead (full rank reproduces the gradient, at more bytes
    than dense). Used alone, :meth:`compress` is the single-rank version of the same step.

    Args:
        rank: a fixed rank; ``None`` derives it from ``cf``.
        epsilon: added to column norms in the orthogonalization (all-zero columns).
        seed: seed of the initial ``Q`` (shared by all ranks).
    """

    name = "powersgd"
    layerwise = True
    communication = Communication.ROUNDS

    def __init__(self, rank: int | None = None, epsilon: float = 1e-8, seed: int = 0) -> None:
        if rank is not None and rank < 1:
            raise ValueError(f"`rank` must be >= 1 or None, got {rank!r}.")
        self.rank, self.epsilon, self.seed = rank, epsilon, seed
        self._q: dict[str, Tensor] = {}
        self._pending: dict[str, Tensor] = {}

    @staticmethod
    def low_rank(tensor: Tensor) -> bool:
        """Whether ``tensor`` is compressed (2-D or more); the rest is sent dense."""
        return tensor.dim() >= 2

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

    def compress(self, tensor: Tensor, cf: float, *, key: str = "", step: int = 0) -> Payload:
        if not self.low_rank(tensor):
            return Payload((tensor.reshape(-1).clone(),), tensor.shape, tensor.dtype)
        matrix = as_matrix(tensor)
        p = self.orthonormalize_(self.project(matrix, self.rank_for(tensor.shape, cf), key))
        return Payload((p, right_factor(matrix, p)), tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload) -> Tensor:
        if len(payload.wire) == 1:
            return payload.wire[0].view(payload.shape).clone()
        p, q = payload.wire
        return (p @ q.T).to(payload.dtype).view(payload.shape)

    def residual_(self, tensor: Tensor, payload: Payload) -> None:
        matrix = as_matrix(tensor)
        if len(payload.wire) == 2 and matrix.data_ptr() == tensor.data_ptr() and matrix.is_contiguous():
            p, q = payload.wire
            add_product_(matrix, p, q, -1.0)  # M - P Q^T in place: no decoded matrix allocated
        else:
            super().residual_(tensor, payload)

    def aggregate_(self, out: Tensor, stacked: Payload, scale: float) -> None:
        if len(stacked.wire) == 1 or out.dtype != torch.float32 or not out.is_contiguous():
            super().aggregate_(out, stacked, scale)
            return
        matrix = out.view(stacked.shape[0], -1)
        for p, q in zip(*stacked.wire, strict=True):  # rank order, each P Q^T added in place
            add_product_(matrix, p, q, scale)

    def sent_sq_norm(self, payload: Payload) -> Tensor:
        if len(payload.wire) == 1:
            return sq_norm(payload.wire[0])
        if payload.dtype != torch.float32:  # decoded with one more rounding, which the closed form does not see
            return super().sent_sq_norm(payload)
        # ||P Q^T||^2 = sum((P^T P) * (Q^T Q)): two rank x rank products instead of the decoded matrix.
        p, q = (w.double() for w in payload.wire)
        return ((p.T @ p) * (q.T @ q)).sum()

    def probe(self, tensor: Tensor, cfs: Sequence[float], *, key: str = "", step: int = 0) -> Tensor:
        if not self.low_rank(tensor):
            return sq_norm(tensor).expand(len(cfs)).clone()
        # ||P Q^T||^2 = ||Q||^2 for orthonormal P: no decoding needed.
        norms = [sq_norm(self.compress(tensor, cf, key=key).wire[1]) for cf in cfs]
        return torch.stack(norms) if norms else torch.zeros(0, dtype=torch.float64, device=tensor.device)

    def commit(self, keys: Sequence[str]) -> None:
        for key in keys:
            if key in self._pending:
                self._q[key] = self._pending.pop(key)

    def discard(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._pending.pop(key, None)

    def state_dict(self) -> dict[str, object]:
        return {f"q/{k}": q.detach().clone() for k, q in self._q.items()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self._q = {k[2:]: t.clone() for k, t in state.items() if isinstance(t, Tensor) and k.startswith("q/")}

    def __repr__(self) -> str:
        return f"PowerSGD(rank={self.rank}, epsilon={self.epsilon}, seed={self.seed})"
