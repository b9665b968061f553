"""GraVAC's link timer: timed all-reduces, and a compressed step's own work, at fit start, so that the first decision
knows what a dense step and a compressed one cost."""

import math
import time
import warnings
from collections.abc import Callable

import pytorch_lightning as pl
import torch
import torch.distributed as dist

from lightning_gravac.compressors.base import Compressor
from lightning_gravac.compressors.packing import Layout
from lightning_gravac.state import HALF, ring_share

#: The all-reduce that measures a message's cost, and the first that measures a byte's (it grows 4x until one takes
#: ``TIMED_SECONDS`` or reaches the model's gradient bytes).
TIMED_BYTES = (1024, 64 * 1024)
TIMED_SECONDS = 0.02
#: The most gradient entries the compression's timing stands noise in for (64 MB of fp32), however large the model.
TIMED_ENTRIES = 1 << 24


def loopback_note(trainer: "pl.Trainer") -> str:
    """Said beside a link's measured speed when every process runs on one machine: their link is its loopback, whose
    speed follows what else the machine runs (one run's 3 Gbit/s is another's 24), not a network's."""
    if getattr(trainer, "num_nodes", 1) != 1:
        return ""
    return " (the processes of one machine: a loopback, not a network; its speed follows the machine's load)"


def link_said(timed: tuple[float, float], trainer: "pl.Trainer", runs: list[float] | None = None) -> str:
    """What GraVAC says on rank 0 of the link timed at fit start (``timed``: seconds a message, seconds a byte), with
    the spread of the timings it took the best of (``runs``: the seconds a byte each gave; none: not said)."""
    spread = ""
    if runs:
        low, high = min(mbits(r) for r in runs), max(mbits(r) for r in runs)
        spread = f", the best of {len(runs)} timings that ranged {low:.0f}-{high:.0f}"
    return (
        f"GraVAC: link measured at fit start: {timed[0] * 1e6:.0f} us a message, {mbits(timed[1]):.0f} Mbit/s{spread}"
        f"{loopback_note(trainer)}."
    )


def mbits(seconds_per_byte: float) -> float:
    """The Mbit/s of a link that moves a byte in ``seconds_per_byte`` (infinite at 0)."""
    return 8 / seconds_per_byte / 1e6 if seconds_per_byte > 0 else math.inf


class LinkTimer:
    """Times all-reduces of a process group on every rank; every result is the slowest rank's, the same everywhere.

    Runs from the training thread, before the first step (or between steps): no comm hook is in flight, and every
    rank must make the same calls. One timer serves a fit: what it timed first sizes what it times next.
    """

    def __init__(
        self, trainer: "pl.Trainer", group: dist.ProcessGroup | None, reduce_max: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        """``reduce_max``: a MAX all-reduce over ``group`` (the controller's), called on every rank."""
        self.group, self.device, self.world_size = group, trainer.strategy.root_device, trainer.world_size
        self.reduce_max = reduce_max
        self.trainable = [(n, p) for n, p in trainer.lightning_module.named_parameters() if p.requires_grad]
        self.numel = sum(p.numel() for _, p in self.trainable)
        #: The bytes of the largest all-reduce :meth:`message_and_byte` timed.
        self.largest = TIMED_BYTES[1]
        #: The seconds a moved byte each of the largest all-reduce's timings gives, each the slowest rank's: the spread
        #: of what :meth:`message_and_byte` took the best of (empty before it).
        self.per_byte_runs: list[float] = []
        self._runs: list[float] = []  # the last :meth:`timed`'s runs, each the slowest rank's

    def message_and_byte(self) -> tuple[float, float]:
        """``(seconds a message, seconds a moved byte)`` of the group's all-reduce.

        Times an all-reduce of 1 KB (the cost a message), then of 64 KB, 256 KB, 1 MB, ... (4x each time) until one
        takes :data:`TIMED_SECONDS` or reaches the model's gradient bytes: a fast link is measured at the sizes it
        will carry, a slow one stops early (100 Mbit/s: at 256 KB, in about 0.1 s). Each size is timed as the best of
        three after one to warm up, and every rank fits the same ``t = latency + moved x per_byte``,
        ``moved = 2 (N - 1) / N x bytes`` (a ring).
        """
        share = ring_share(self.world_size)
        small = TIMED_BYTES[0]
        t_small = self.timed(small, torch.float32)
        size, t_large = self.grown(torch.float32)
        self.largest = size
        per_byte = (t_large - t_small) / (share * (size - small))
        if per_byte <= 0:  # noise on a fast link: all of it per byte
            self.per_byte_runs = [t / (share * size) for t in self._runs]
            return 0.0, t_large / (share * size)
        self.per_byte_runs = [max(0.0, t - t_small) / (share * (size - small)) for t in self._runs]
        return max(0.0, t_small - per_byte * share * small), per_byte

    def half(self, cast: Compressor, latency: float) -> tuple[float, float]:
        """``(seconds a moved byte of an fp16 all-reduce, seconds the casts of a half step take)``: what sending a step
        whole in fp16 costs, measured rather than assumed (gloo reduces fp16 on the CPU element by element, so an
        fp16 sum is not always half an fp32 one's time). The all-reduce carries as many entries as the largest fp32
        timing (:attr:`largest`; its cost a message is ``latency``); the casts are ``cast``'s compress, rounding
        residual and decode on the model's gradient size, best of three."""
        share = ring_share(self.world_size)
        size = max(2, self.largest // 2)
        seconds = self.timed(size, torch.float16)
        per_byte = max(0.0, seconds - latency) / (share * size)
        gradient = torch.zeros(max(1, self.numel), device=self.device)

        def casts() -> None:
            payload = cast.compress(gradient, HALF)
            cast.residual_(gradient, payload)
            cast.decode_(gradient, payload.with_wire([w.unsqueeze(0) for w in payload.wire]), 1.0)

        return per_byte, self.quietly_timed(casts, 1.0)

    def compression(self, compressor: Compressor, cf: float, residual: bool) -> float:
        """The seconds a compressed step's selection, encoding and decoding take, measured rather than assumed: on a
        fast link they, not the bytes, decide whether compressing pays. Each trainable parameter's gradient is stood in
        for by seeded noise of its shape and dtype, compressed at ``cf`` (under keys of its own, its pending state
        discarded: the run's state and random streams are left as they are), its sent norm taken as the header does,
        its residual formed (``residual``: error feedback on), and every rank's payload decoded (one, for payloads
        summed by the all-reduce); best of three, the slowest rank's. A model of more than :data:`TIMED_ENTRIES`
        entries is timed on its first parameters (the last one's leading rows) and scaled to the whole."""
        generator = torch.Generator(device="cpu").manual_seed(0)
        gradients, left = {}, TIMED_ENTRIES
        for name, p in self.trainable:
            if left <= 0:
                break
            if p.numel() == 0:
                continue
            shape = p.shape
            if p.numel() > left and p.dim() > 0:
                shape = torch.Size((max(1, left * shape[0] // p.numel()), *shape[1:]))
            gradients[f"timed/{name}"] = torch.randn(shape, generator=generator).to(self.device, p.dtype)
            left -= shape.numel()
        timed = sum(g.numel() for g in gradients.values())
        decoded = 1 if compressor.summable else self.world_size

        def step() -> None:
            for key, gradient in gradients.items():
                payload = compressor.compress(gradient, cf, key=key)
                compressor.sent_sq_norm(payload)
                if residual:
                    compressor.residual_(gradient.clone(), payload)
                stacked = payload.with_wire([torch.stack([w] * decoded) for w in payload.wire])
                out = torch.empty(gradient.numel(), device=self.device, dtype=gradient.dtype)
                compressor.decode_(out, stacked, 1.0)
            compressor.discard(list(gradients))

        return self.quietly_timed(step, self.numel / max(1, timed))

    def round(self, method: Compressor, cf: float) -> float:
        """The seconds a round of local steps spends beyond moving its bytes, measured rather than assumed (its
        compression alone is about half of it): on stand-ins of the model's size in fp32 (seeded noise, capped at
        :data:`TIMED_ENTRIES` and scaled), the change formed, compressed by ``method`` at ``cf`` (under a key of its
        own, discarded after), packed, every rank's payload unpacked and decoded into the mean, the outer step and the
        parameters set to it; best of three, the slowest rank's."""
        generator = torch.Generator(device="cpu").manual_seed(0)
        numel = max(1, min(self.numel, TIMED_ENTRIES))
        anchor = torch.randn(numel, generator=generator).to(self.device)
        params = anchor + torch.randn(numel, generator=generator).to(self.device)
        stepped = torch.empty_like(anchor)

        def work() -> None:
            change = anchor - params
            payload = method.compress(change, cf, key="timed/round")
            layout = Layout.of([payload])
            gathered = layout.pack([payload]).repeat(self.world_size)
            _, (stacked,) = layout.unpack(gathered.view(self.world_size, layout.nbytes), [payload])
            mean = torch.empty_like(change)
            method.decode_(mean, stacked, 1.0 / self.world_size)
            torch.sub(anchor, mean, out=stepped)
            params.copy_(stepped)
            torch.sub(anchor, change, out=params)  # back as they were (stands for the round's concatenation)

        seconds = self.quietly_timed(work, self.numel / numel)
        method.discard(["timed/round"])
        return seconds

    def grown(self, dtype: torch.dtype) -> tuple[int, float]:
        """``(bytes, seconds)`` of the all-reduce from 64 KB up, 4x a time, until one takes ``TIMED_SECONDS`` or
        carries the model's gradient (in ``dtype``)."""
        model_bytes = self.numel * torch.empty((), dtype=dtype).element_size()
        size = TIMED_BYTES[1]
        seconds = self.timed(size, dtype)
        while seconds < TIMED_SECONDS and size < model_bytes:
            size = min(4 * size, max(model_bytes, TIMED_BYTES[1]))
            seconds = self.timed(size, dtype)
        return size, seconds

    def timed(self, nbytes: int, dtype: torch.dtype) -> float:
        """The slowest rank's best of three all-reduces of ``nbytes`` of ``dtype`` (after one to warm up); each run's,
        the slowest rank's, kept (in the same collective)."""
        width = torch.empty((), dtype=dtype).element_size()
        tensor = torch.zeros(max(1, nbytes // width), dtype=dtype, device=self.device)
        dist.all_reduce(tensor, group=self.group)
        runs = self.runs_of_three(lambda: dist.all_reduce(tensor, group=self.group))
        best, *self._runs = self.reduce_max(torch.tensor([min(runs), *runs], dtype=torch.float64)).tolist()
        return float(best)

    def quietly_timed(self, work: Callable[[], object], scale: float) -> float:
        """The slowest rank's best of three runs of ``work``, times ``scale`` (the model's entries over those timed),
        what a method says of a factor it cannot reach silenced: it says it again when it sends."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            seconds = self.best_of_three(work)
        return self.slowest(seconds * scale)

    def best_of_three(self, work: Callable[[], object]) -> float:
        """This rank's fastest of three runs of ``work``."""
        return min(self.runs_of_three(work))

    def runs_of_three(self, work: Callable[[], object]) -> list[float]:
        """This rank's seconds of three runs of ``work``."""
        # A CUDA collective or kernel returns before it completes: wait for the device around each timing (untested
        # here, no GPU). Gloo's all-reduce and CPU ops are synchronous.
        synchronize = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        runs = []
        for _ in range(3):
            synchronize()
            start = time.perf_counter()
            work()
            synchronize()
            runs.append(time.perf_counter() - start)
        return runs

    def slowest(self, seconds: float) -> float:
        """The largest of every rank's ``seconds``."""
        return float(self.reduce_max(torch.tensor([seconds], dtype=torch.float64)).item())
