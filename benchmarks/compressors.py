"""Throughput of error feedback + compress + decompress per compressor, beside a copy and a naive Top-K.

    python benchmarks/compressors.py [--numel 25000000] [--cfs 100 1000] [--rounds 5] [--methods topk dgc ...]

One process, the gradient as one fp32 tensor of ``--numel`` entries (default 25M, 100 MB), drawn from a Student-t
with 3 degrees of freedom (gradients are heavy-tailed); PowerSGD and 1-bit SGD get it as a ``[numel / 5000, 5000]``
matrix, the shape of a layer's weight (a 1-D tensor PowerSGD sends dense). For each method and factor one iteration is
what the hook does to one segment on one rank, in its order:

1. error feedback: the gradient plus the stored residual, into a buffer the memory recycles;
2. compress to the factor (the casts into the bucket's recycled buffer, as the hook's all-reduce path writes them),
   the squared norm of what was compressed and of what is sent (the header's, for the
   gain: ``sent_sq_norm``, which the hook computes beside every payload);
3. the new residual, in place in that buffer, stored (1-3 are the hook's own ``encode``);
4. decode into the bucket (``decode_`` of this rank's payload, as the hook decodes every rank's: written in one
   pass by the casts, added into the zeroed bucket by the others).

DGC keeps its own accumulation instead of steps 1 and 3 (its state update is committed in the timing); methods the
strategy runs without error feedback by default (casts, QSGD, TernGrad, signSGD) skip them.

Rows are timed interleaved, round by round, against two baselines of the same size measured in the same round:
``copy`` (``dst.copy_(src)``, the memory-bandwidth ceiling of touching the gradient once) and the straightforward
Top-K (``topk(|g|)`` sorted, int64 indices, gather, ``zeros`` + ``scatter_``, ``g - decoded``). Reports the median
milliseconds, GB/s of gradient (``4 numel / t``), the ratios to the copy and to the naive Top-K, and the bytes a method
keeps between steps per parameter (residuals and their recycled buffers, DGC's u and v, PowerSGD's Q, scratch) beside
stock DDP's none (its buckets, which every row has as well, aside).

With ``--standalone`` a ``fresh tensor`` row times ``torch.zeros_like(gradient)``: the floor of every "on its own" row,
whose ``decompress`` returns a new tensor (memory this large comes fresh from the system each time, every 4 KB page
faulted in on first touch; the hook's path decodes into the bucket and pays none of it). PyTorch's
``THP_MEM_ALLOC_ENABLE=1`` backs large CPU tensors with 2 MB pages, which cuts that floor several times over; the
header line says whether it was set.
"""

import argparse
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable

import torch

from lightning_gravac.adaptations import ErrorFeedback
from lightning_gravac.adaptations.residuals import encode
from lightning_gravac.compressors import get_compressor, list_compressors

SPARSIFIERS = ("topk", "dgc", "redsync", "sidco", "threshold", "randomk")
#: Methods whose work depends on a weight's shape, given the gradient as a ``[rows, 5000]`` matrix (a 1-D tensor is
#: sent dense by PowerSGD, and is a single column to 1-bit SGD): the same entries, the shape of a layer's weight.
MATRIX_METHODS = ("powersgd", "onebit")


def shaped(name: str, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as ``name`` sees it in the benchmark: a ``[rows, 5000]`` matrix for :data:`MATRIX_METHODS`."""
    return grad.view(-1, 5000) if name in MATRIX_METHODS and grad.numel() % 5000 == 0 else grad


def _pipeline(name: str, cf: float, grad: torch.Tensor) -> Callable[[], None]:
    options = {"warmup_epochs": 0, "clip_norm": None} if name == "dgc" else {}
    compressor = get_compressor(name, **options)
    memory = ErrorFeedback()
    work = grad.clone()
    memory.set("g", torch.zeros_like(grad))
    # The casts write their payload into the bucket's recycled buffer, as the hook's summed path does.
    wire = None if compressor.wire_dtype is None else torch.empty(grad.numel(), dtype=compressor.wire_dtype)

    def run() -> None:
        work.copy_(grad)  # the fresh gradient in the bucket: not part of the method, not timed
        start = time.perf_counter()
        # As the strategy does: error feedback for biased methods that keep no residual of their own (DGC keeps its
        # accumulation instead; unbiased methods and signSGD go without), through the hook's own `encode`.
        residual_mode = "recycle" if compressor.error_feedback_default else "off"
        encoded = encode(compressor, work, cf, key="g", residual_mode=residual_mode, memory=memory, out=wire)
        payload = encoded.payload
        compressor.sent_sq_norm(payload)  # the header's ||C(g)||^2, which the hook sends beside every payload
        if encoded.residual is not None:
            memory.set("g", encoded.residual)
        compressor.commit(["g"])
        compressor.decode_(
            work.view(-1), payload.with_wire([w.unsqueeze(0) for w in payload.wire]), 1.0
        )  # a flat bucket
        run.elapsed = time.perf_counter() - start  # type: ignore[attr-defined]

    run.kept = lambda: kept_bytes(compressor, memory, wire)  # type: ignore[attr-defined]
    return run


def _standalone(name: str, cf: float, grad: torch.Tensor) -> Callable[[], None]:
    """The method on its own, as the README shows it (no process group, no error feedback of the strategy's):
    ``decompress(compress(g))``, then ``commit`` (what a stateful method such as DGC needs between steps)."""
    options = {"warmup_epochs": 0, "clip_norm": None} if name == "dgc" else {}
    compressor = get_compressor(name, **options)
    work = grad.clone()

    def run() -> None:
        work.copy_(grad)
        start = time.perf_counter()
        compressor.decompress(compressor.compress(work, cf, key="g", step=0))
        compressor.commit(["g"])
        run.elapsed = time.perf_counter() - start  # type: ignore[attr-defined]

    run.kept = lambda: kept_bytes(compressor)  # type: ignore[attr-defined]
    return run


def kept_bytes(*holders: object) -> int:
    """Bytes of the tensors ``holders`` keep between steps (residuals, recycled buffers, a method's own state such as
    DGC's u and v or PowerSGD's Q, scratch), each storage counted once: walks their attributes, dicts and lists."""
    seen: set[int] = set()
    total = 0

    def walk(value: object, depth: int) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif depth > 4:
            return
        elif isinstance(value, dict):
            for item in value.values():
                walk(item, depth + 1)
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item, depth + 1)
        elif type(value).__module__.startswith("lightning_gravac"):
            for item in vars(value).values():
                walk(item, depth + 1)

    for holder in holders:
        walk(holder, 0)
    return total


def _naive(cf: float, grad: torch.Tensor) -> Callable[[], None]:
    k = max(1, round(grad.numel() / (2 * cf)))  # value + int32-sized index budget, as topk's accounting
    residual = torch.zeros_like(grad)
    work = grad.clone()

    def run() -> None:
        nonlocal residual
        work.copy_(grad)
        start = time.perf_counter()
        fed = work + residual
        _, indices = torch.topk(fed.abs(), k)  # sorted, int64
        values = fed.gather(0, indices)
        decoded = torch.zeros_like(fed).scatter_(0, indices, values)
        residual = fed - decoded
        run.elapsed = time.perf_counter() - start  # type: ignore[attr-defined]

    return run


def _copy(grad: torch.Tensor) -> Callable[[], None]:
    dst = torch.empty_like(grad)

    def run() -> None:
        start = time.perf_counter()
        dst.copy_(grad)
        run.elapsed = time.perf_counter() - start  # type: ignore[attr-defined]

    return run


def _fresh(grad: torch.Tensor) -> Callable[[], None]:
    """A new zeroed tensor of the gradient's size: what a method on its own pays for ``decompress``'s output before any
    decoding (an allocation this large is fresh memory each time, its pages faulted in on first touch)."""

    def run() -> None:
        start = time.perf_counter()
        torch.zeros_like(grad)
        run.elapsed = time.perf_counter() - start  # type: ignore[attr-defined]

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--cfs", type=float, nargs="+", default=[100.0, 1000.0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--methods", nargs="+", default=[n for n in list_compressors() if n != "none"])
    parser.add_argument("--standalone", action="store_true", help="also time each method on its own (README's use)")
    parser.add_argument("--json", help="also write the raw figures here")
    args = parser.parse_args()
    # The quantizers' fixed factors: the table shows what they achieve; one warning each is noise here.
    warnings.filterwarnings("ignore", message=".*out of the method's reach")

    grad = torch.distributions.StudentT(3.0).sample((args.numel,)).float()
    rows: dict[tuple[str, float], Callable[[], None]] = {("copy", 1.0): _copy(grad)}
    if args.standalone:
        rows[("fresh tensor", 1.0)] = _fresh(grad)
    for cf in args.cfs:
        rows[("naive topk", cf)] = _naive(cf, grad)
        for name in args.methods:
            rows[(name, cf)] = _pipeline(name, cf, shaped(name, grad))
            if args.standalone:
                rows[(f"{name} (on its own)", cf)] = _standalone(name, cf, shaped(name, grad))

    times: dict[tuple[str, float], list[float]] = {key: [] for key in rows}
    for run in rows.values():  # warm-up: allocations, first-touch page faults
        run()
    for _ in range(args.rounds):
        for key, run in rows.items():
            run()
            times[key].append(run.elapsed)  # type: ignore[attr-defined]

    gigabytes = args.numel * 4 / 1e9
    copy_s = statistics.median(times[("copy", 1.0)])
    print(
        f"{args.numel / 1e6:g}M fp32 entries ({gigabytes * 1e3:.0f} MB), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; median of {args.rounds} "
        f"interleaved rounds; THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}\n"
    )
    print("| method | cf | ms | GB/s | ratio to copy | speed-up over naive Top-K | bytes kept a parameter |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    results = []
    for (name, cf), samples in times.items():
        seconds = statistics.median(samples)
        naive = statistics.median(times[("naive topk", cf)]) if ("naive topk", cf) in times else float("nan")
        row = {
            "method": name,
            "cf": cf,
            "ms": seconds * 1e3,
            "gb_per_s": gigabytes / seconds,
            "ratio_to_copy": copy_s / seconds,
            "speedup_over_naive": naive / seconds,
            # Stock DDP keeps none beyond its buckets (which every row shares); the naive row keeps its residual.
            "kept_bytes_per_parameter": rows[(name, cf)].kept() / args.numel
            if hasattr(rows[(name, cf)], "kept")
            else (4.0 if name == "naive topk" else 0.0),
        }
        results.append(row)
        speedup = "" if name in ("copy", "naive topk", "fresh tensor") else f"{row['speedup_over_naive']:.1f}x"
        print(
            f"| {name} | {cf:g} | {row['ms']:.1f} | {row['gb_per_s']:.2f} | {row['ratio_to_copy']:.3f} | {speedup} "
            f"| {row['kept_bytes_per_parameter']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": args.numel, "rounds": args.rounds, "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()
