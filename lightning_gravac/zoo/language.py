"""Word-level language modelling: the two-layer LSTM on Penn Treebank, as the compression papers train it.

Data are the standard ``ptb.train.txt``, ``ptb.valid.txt`` and ``ptb.test.txt`` (one sentence a line, words separated
by spaces, ``<unk>`` already in place); each line ends with ``<eos>``. Each rank cuts its share of the token stream
into ``batch_size`` parallel streams and reads them in order, ``bptt`` tokens a step, so that the LSTM's hidden state
carries over from one batch to the next (truncated back-propagation through time).
"""

import math
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchmetrics.text import Perplexity

from lightning_gravac.missing_data import MissingData
from lightning_gravac.zoo.optim import configure_sgd

SPLITS = {"train": "ptb.train.txt", "valid": "ptb.valid.txt", "test": "ptb.test.txt"}
#: Tokens (words and ``<eos>``) in the real splits, and the vocabulary size: what synthetic mode reproduces.
PTB_TOKENS = {"train": 929_589, "valid": 73_760, "test": 82_430}
PTB_VOCAB = 10_000


def read_tokens(path: Path) -> list[str]:
    """The words of a PTB file, ``<eos>`` after every line."""
    if not Path(path).is_file():
        raise MissingData(
            f"PTB: expected {path} (the standard ptb.train.txt / ptb.valid.txt / ptb.test.txt). Place the files "
            "there, or train on a token stream of the same size with `synthetic: true` (on the command line: "
            "data.init_args.synthetic=true)."
        )
    tokens: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            tokens += [*line.split(), "<eos>"]
    return tokens


def synthetic_stream(length: int, vocab: int, seed: int) -> Tensor:
    """``length`` token ids: phrases of 8 words drawn from a fixed table of 2000, phrases and words Zipf-distributed.

    Learnable (within a phrase the next word is determined) and fast to make (no per-token loop). The phrase table is
    the same for every ``seed`` (one language); ``seed`` draws the sequence of phrases.
    """
    word_weights = 1 / torch.arange(1, vocab + 1, dtype=torch.float)
    table = torch.Generator().manual_seed(0)
    phrases = torch.multinomial(word_weights, 2000 * 8, replacement=True, generator=table).view(2000, 8)
    phrase_weights = 1 / torch.arange(1, 2001, dtype=torch.float)
    g = torch.Generator().manual_seed(seed)
    picks = torch.multinomial(phrase_weights, -(-length // 8), replacement=True, generator=g)
    return phrases[picks].reshape(-1)[:length].clone()


class Streams(Dataset):
    """``(inputs, targets)`` windows of ``bptt`` tokens over ``rows`` parallel streams: window ``i`` follows window
    ``i - 1`` in every row, so a model that reads them in order can carry its hidden state across them."""

    def __init__(self, stream: Tensor, rows: int, bptt: int) -> None:
        usable = (stream.numel() - 1) // rows * rows
        self.data = stream[: usable + 1]
        self.rows, self.bptt = rows, bptt
        self.columns = usable // rows

    def __len__(self) -> int:
        return math.ceil((self.columns - 1) / self.bptt) if self.columns > 1 else 0

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} of {len(self)}")
        start = i * self.bptt
        inputs = self.data[: self.rows * self.columns].view(self.rows, self.columns)
        targets = self.data[1 : self.rows * self.columns + 1].view(self.rows, self.columns)
        return inputs[:, start : start + self.bptt], targets[:, start : start + self.bptt]


class RankShares(Dataset):
    """Every rank's contiguous share of a token stream as :class:`Streams`, interleaved: item ``t * world + r`` is
    window ``t`` of rank ``r``'s share. :func:`rank_loader` reads it with a ``DistributedSampler`` that does not
    shuffle, so each rank reads its own text in order, and Lightning, which adds no sampler where the loader has a
    distributed one, leaves it so."""

    def __init__(self, stream: Tensor, world: int, rows: int, bptt: int) -> None:
        share = stream.numel() // world
        self.world = world
        self.shares = [Streams(stream[r * share : (r + 1) * share + 1], rows, bptt) for r in range(world)]

    def __len__(self) -> int:
        # The last share can be a window shorter (a token fewer): every rank reads as many windows as the shortest.
        return self.world * min(len(share) for share in self.shares)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        step, rank = divmod(i, self.world)
        return self.shares[rank][step]


def rank_loader(stream: Tensor, world: int, rank: int, rows: int, bptt: int) -> DataLoader:
    """This rank's windows of ``stream`` in order (:class:`RankShares`), each window a batch."""
    shares = RankShares(stream, world, rows, bptt)
    sampler: DistributedSampler[int] = DistributedSampler(shares, num_replicas=world, rank=rank, shuffle=False)
    return DataLoader(shares, batch_size=None, sampler=sampler)


class PTBDataModule(pl.LightningDataModule):
    """Penn Treebank, or a synthetic stream of its size and vocabulary.

    Args:
        root: the folder holding ``ptb.train.txt``, ``ptb.valid.txt``, ``ptb.test.txt``.
        batch_size: parallel streams per rank (the papers' 32).
        bptt: tokens per step (35).
        synthetic: a generated token stream of PTB's sizes instead of files.
        synthetic_tokens: training tokens in synthetic mode (default: PTB's 929,589).
    """

    def __init__(
        self,
        root: str = "data/ptb",
        batch_size: int = 32,
        bptt: int = 35,
        synthetic: bool = False,
        synthetic_tokens: int | None = None,
    ) -> None:
        super().__init__()
        self.root, self.batch_size, self.bptt = Path(root), batch_size, bptt
        self.synthetic, self.synthetic_tokens = synthetic, synthetic_tokens
        self.vocab: dict[str, int] = {}
        self.splits: dict[str, Tensor] = {}
        self._vocab_size = PTB_VOCAB if synthetic else None

    @property
    def vocab_size(self) -> int:
        """Words in the vocabulary (known once the training split is read; PTB's 10,000 in synthetic mode)."""
        if self._vocab_size is None:
            self._load()
        assert self._vocab_size is not None
        return self._vocab_size

    def _load(self) -> None:
        if self.splits:
            return
        if self.synthetic:
            train = self.synthetic_tokens or PTB_TOKENS["train"]
            sizes = {
                "train": train,
                **{s: max(2, train * PTB_TOKENS[s] // PTB_TOKENS["train"]) for s in ("valid", "test")},
            }
            self.splits = {s: synthetic_stream(n, PTB_VOCAB, seed=i) for i, (s, n) in enumerate(sizes.items())}
            return
        words = {split: read_tokens(self.root / name) for split, name in SPLITS.items()}
        for word in words["train"]:
            self.vocab.setdefault(word, len(self.vocab))
        unknown = [w for w in {*words["valid"], *words["test"]} if w not in self.vocab]
        if unknown:
            raise ValueError(f"PTB: words outside the training vocabulary: {sorted(unknown)[:5]}...")
        self.splits = {split: torch.tensor([self.vocab[w] for w in ws]) for split, ws in words.items()}
        self._vocab_size = len(self.vocab)

    def setup(self, stage: str) -> None:
        self._load()

    def _loader(self, split: str) -> DataLoader:
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer else (1, 0)
        return rank_loader(self.splits[split], world, rank, self.batch_size, self.bptt)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("valid")


class LSTMLanguageModel(pl.LightningModule):
    """Embedding, a two-layer LSTM and a decoder tied to the embedding; the hidden state carries across batches.

    The paper's large configuration: 1500-wide embedding and hidden state, dropout 0.65, 35-step BPTT, gradient
    norm clipped to 0.25 (set ``gradient_clip_val`` on the Trainer). Reports perplexity from torchmetrics.

    Args:
        vocab_size: words; ``None`` takes ``vocab_size`` from the trainer's data module.
        embedding: embedding width (equal to ``hidden`` when the decoder is tied).
        hidden: LSTM width.
        layers: LSTM layers.
        dropout: dropout on the embedding, between layers and before the decoder.
        tie_weights: share the embedding matrix with the decoder.
        lr, momentum, weight_decay, milestones, gamma, scale_lr, reference_batch, warmup_epochs: the optimizer's,
            as :func:`~lightning_gravac.zoo.optim.configure_sgd` reads them (momentum 0 with DGC, whose momentum
            correction applies it; ``scale_lr`` for Goyal et al.'s large-minibatch rule).
    """

    def __init__(
        self,
        vocab_size: int | None = None,
        embedding: int = 1500,
        hidden: int = 1500,
        layers: int = 2,
        dropout: float = 0.65,
        tie_weights: bool = True,
        lr: float = 20.0,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        milestones: list[int] | None = None,
        gamma: float = 0.25,
        scale_lr: bool = False,
        reference_batch: int = 256,
        warmup_epochs: float = 0.0,
    ) -> None:
        super().__init__()
        if tie_weights and embedding != hidden:
            raise ValueError(f"Tied weights need `embedding` == `hidden`, got {embedding} and {hidden}.")
        self.save_hyperparameters()
        self._hidden: dict[str, tuple[Tensor, Tensor] | None] = {"train": None, "val": None}
        self.built = False
        if vocab_size is not None:
            self._build(vocab_size)

    def _build(self, vocab_size: int) -> None:
        h = self.hparams
        self.encoder = nn.Embedding(vocab_size, h["embedding"])
        self.lstm = nn.LSTM(h["embedding"], h["hidden"], h["layers"], dropout=h["dropout"], batch_first=True)
        self.decoder = nn.Linear(h["hidden"], vocab_size)
        if h["tie_weights"]:
            self.decoder.weight = self.encoder.weight
        self.drop = nn.Dropout(h["dropout"])
        # Small uniform embeddings (the word_language_model initialization): N(0, 1) rows, tied to the decoder, make
        # the first logits huge.
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        self.perplexity = Perplexity()
        self.built = True

    def configure_model(self) -> None:
        if not self.built:
            vocab_size = getattr(self.trainer.datamodule, "vocab_size", None)  # type: ignore[attr-defined]
            if vocab_size is None:
                raise ValueError("LSTMLanguageModel: pass `vocab_size` or use a data module that has `vocab_size`.")
            self.hparams["vocab_size"] = vocab_size
            self._build(vocab_size)

    def forward(self, tokens: Tensor, state: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Any]:
        out, state = self.lstm(self.drop(self.encoder(tokens)), state)
        return self.decoder(self.drop(out)), state

    def _step(self, batch: tuple[Tensor, Tensor], phase: str) -> tuple[Tensor, Tensor]:
        inputs, targets = batch
        state = self._hidden[phase]
        if state is not None and state[0].shape[1] != inputs.shape[0]:
            state = None  # a last, narrower batch
        logits, state = self(inputs, state)
        # Carried into the next batch, cut from this one's graph (truncated BPTT).
        self._hidden[phase] = (state[0].detach(), state[1].detach())
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def on_train_epoch_start(self) -> None:
        self._hidden["train"] = None

    def on_validation_epoch_start(self) -> None:
        self._hidden["val"] = None

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        _, loss = self._step(batch, "train")
        self.log("train_loss", loss, on_step=True, prog_bar=True)
        self.log("train_ppl", loss.detach().exp(), on_step=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        logits, loss = self._step(batch, "val")
        self.perplexity(logits, batch[1])
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_ppl", self.perplexity, prog_bar=True)

    def configure_optimizers(self) -> Any:
        return configure_sgd(self)
