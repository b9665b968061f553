"""Embedding tables sent by the rows their step touched: the same sum as a dense all-reduce, in fewer bytes.

Two ranks through Lightning's Trainer, an ``nn.EmbeddingBag`` with a dense gradient under AdamW (whose
per-coordinate scaling shows any difference at once): the rows path gives stock DDP's weights bit for bit, sends a
fraction of the bytes, and a half step by rows gives the whole fp16 cast's weights bit for bit.
"""

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gravac import Controller, GraVACStrategy, RunSummary, Static
from lightning_gravac.launch import run_distributed
from lightning_gravac.state import CompressionState, Factors
from lightning_gravac.tables import RowTables, untied_tables

from models import SimulatedLink, trainer_kwargs, weights

pytestmark = pytest.mark.distributed


class Bag(pl.LightningModule):
    """``nn.EmbeddingBag(vocab, 16)`` (a dense gradient) under a ``Linear(16, 1)``, AdamW; each batch of 8 bags of 5
    ids touches at most 40 of the ``vocab`` rows on a rank."""

    def __init__(self, vocab: int = 512) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, 16, mode="sum")
        self.head = nn.Linear(16, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, y = batch
        return nn.functional.mse_loss(self.head(self.bag(tokens)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _loader(vocab: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (96, 5), generator=g)
    return DataLoader(TensorDataset(tokens, torch.randn(96, 1, generator=g)), batch_size=8)


class Halves(Controller):
    """Every step whole in fp16 (the 16-bit rung an adaptive controller may choose)."""

    def decide(self, state: CompressionState) -> Factors:
        return Factors(cf=1.0, half=True)


class Bytes(pl.Callback):
    """The bytes each step sent and stock DDP's, as the controller measured them."""

    def __init__(self) -> None:
        self.sent: list[float] = []
        self.dense: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        metrics = trainer.callback_metrics
        if "gravac/bytes_sent" in metrics:
            self.sent.append(float(metrics["gravac/bytes_sent"]))
            self.dense.append(float(metrics["gravac/bytes_dense"]))


def _fit(rank: int, world_size: int, setup: str, vocab: int, steps: int = 6) -> dict[str, Any]:
    strategies = {
        "stock": lambda: (DDPStrategy(), []),
        "rows": lambda: (GraVACStrategy("none"), [Static(cf=1)]),
        "whole": lambda: (GraVACStrategy("none", embedding_rows=False), [Static(cf=1)]),
        "half rows": lambda: (GraVACStrategy("none"), [Halves()]),
        "half whole": lambda: (GraVACStrategy("none", embedding_rows=False), [Halves()]),
        "half rows fed": lambda: (GraVACStrategy("topk"), [Halves()]),  # error feedback keeps the cast's rounding
        "half whole fed": lambda: (GraVACStrategy("topk", embedding_rows=False), [Halves()]),
    }
    strategy, controllers = strategies[setup]()
    pl.seed_everything(0)
    model, measured = Bag(vocab), Bytes()
    trainer = pl.Trainer(strategy=strategy, callbacks=[*controllers, measured], **trainer_kwargs(2, max_steps=steps))
    trainer.fit(model, _loader(vocab))
    return {"weights": weights(model), "sent": measured.sent, "dense": measured.dense}


def _run(setup: str, vocab: int = 512, steps: int = 6) -> list[dict[str, Any]]:
    return run_distributed(_fit, world_size=2, timeout=240, setup=setup, vocab=vocab, steps=steps)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_table_by_its_touched_rows_gives_stock_ddp_bit_for_bit_in_a_fraction_of_the_bytes():
    stock, rows, whole = _run("stock"), _run("rows"), _run("whole")
    for rank in (0, 1):
        assert _same(rows[rank]["weights"], stock[rank]["weights"])
        assert _same(whole[rank]["weights"], stock[rank]["weights"])
    # At most 80 of 512 rows touched on the two ranks: the rows and a byte a row, against the whole table.
    sent, dense = rows[0]["sent"], rows[0]["dense"]
    assert len(sent) == 6 and all(s < 0.25 * d for s, d in zip(sent, dense, strict=True))
    assert whole[0]["sent"] == whole[0]["dense"]


def test_a_half_step_by_rows_gives_the_whole_fp16_cast_bit_for_bit():
    rows, whole = _run("half rows"), _run("half whole")
    for rank in (0, 1):
        assert _same(rows[rank]["weights"], whole[rank]["weights"])
    sent, dense = rows[0]["sent"], rows[0]["dense"]  # fp16 rows: half the bytes again
    assert len(sent) == 6 and all(s < 0.15 * d for s, d in zip(sent, dense, strict=True))


def test_half_steps_of_a_bucket_with_tables_keep_no_rounding_under_error_feedback_by_rows_or_whole():
    # Top-K's error feedback would keep each half step's rounding; a bucket with a table keeps none (a rounding left on
    # a row would make it look touched next step), so both equal the cast without error feedback, bit for bit. 128
    # rows, up to 40 ids a rank: the two ranks' union is about half the table, more on some steps (then whole).
    plain = _run("half whole", vocab=128, steps=110)
    rows, whole = _run("half rows fed", vocab=128, steps=110), _run("half whole fed", vocab=128, steps=110)
    for rank in (0, 1):
        assert _same(rows[rank]["weights"], plain[rank]["weights"])
        assert not _same(whole[rank]["weights"], plain[rank]["weights"])  # whole tables alone keep the rounding
    by_rows = [s < 0.45 * d for s, d in zip(rows[0]["sent"], rows[0]["dense"], strict=True)]
    first_whole = by_rows.index(False)
    assert len(by_rows) == 110 and first_whole > 0 and not any(by_rows[first_whole : first_whole + 100])


def test_a_table_whose_steps_touch_most_rows_goes_whole_and_trains_as_stock_ddp():
    # 40 ids a rank on 32 rows: more than half the table each step.
    stock, rows = _run("stock", vocab=32), _run("rows", vocab=32)
    assert _same(rows[0]["weights"], stock[0]["weights"])
    assert rows[0]["sent"][1:] == rows[0]["dense"][1:]  # after the first step asked, the table goes whole unasked


def test_only_untied_dense_gradient_tables_are_sent_by_rows():
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.words = nn.Embedding(100, 8)
            self.tied = nn.Embedding(50, 8)
            self.out = nn.Linear(8, 50)
            self.out.weight = self.tied.weight
            self.sparse = nn.EmbeddingBag(30, 8, sparse=True)
            self.frozen = nn.Embedding(20, 8)
            self.frozen.weight.requires_grad_(False)

    model = Model()
    assert {id(p) for p in untied_tables(model)} == {id(model.words.weight), id(model.sparse.weight),
                                                     id(model.frozen.weight)}  # fmt: skip
    tables = RowTables()
    tables.find(model, world_size=2)
    assert tables.rows == {"words.weight": 100}
    off = RowTables(enabled=False)
    off.find(model, world_size=2)
    assert off.rows == {}
    alone = RowTables()
    alone.find(model, world_size=1)  # nothing to send to
    assert alone.rows == {}
    assert tables.in_bucket(["out.bias", "words.weight"], step=0) == [1]
    assert not tables.observe("words.weight", 51, step=3)  # more than half: whole, and not asked again for a while
    assert tables.in_bucket(["words.weight"], step=102) == [] and tables.in_bucket(["words.weight"], step=103) == [0]
    assert tables.observe("words.weight", 50, step=103)


def _default_resumed(rank: int, world_size: int, ckpt_dir: str) -> dict[str, Any]:
    def run(callbacks: list[pl.Callback], ckpt_path: str | None = None) -> dict[str, Any]:
        pl.seed_everything(0)
        model, summary = Bag(), RunSummary()
        # Six steps an epoch a rank. The default's method and controller (Adam held: the bag is all table), on a
        # modelled 10 Mbit/s link so that its dense-or-fp16 choices follow the bytes alone, the same in every run.
        trainer = pl.Trainer(strategy=GraVACStrategy(), callbacks=[SimulatedLink(search="model"), summary, *callbacks],
                             **trainer_kwargs(world_size, max_steps=24, enable_checkpointing=True))  # fmt: skip
        trainer.fit(model, _loader(512), ckpt_path=ckpt_path)
        history = summary.history
        return {"weights": weights(model), "cf": [r["gravac/cf"] for r in history],
                "sent": [r["gravac/bytes_sent"] / r["gravac/bytes_dense"] for r in history]}  # fmt: skip

    whole = run([ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=12, save_top_k=-1)])
    return {"whole": whole, "resumed": run([], ckpt_path=f"{ckpt_dir}/epoch=1-step=12.ckpt")}


def test_the_default_under_adamw_sends_the_tables_rows_agrees_across_ranks_and_resumes_bit_for_bit(tmp_path):
    ranks = run_distributed(_default_resumed, world_size=2, timeout=300, ckpt_dir=str(tmp_path))
    whole = ranks[0]["whole"]
    assert len(whole["cf"]) == 24 and set(whole["cf"]) <= {1.0, 2.0}  # held: dense or fp16
    assert all(share < 0.25 for share in whole["sent"])  # by rows, whichever of the two
    for rank in ranks:
        assert rank["whole"]["cf"] == whole["cf"] and rank["resumed"]["cf"] == whole["cf"][12:]
        assert _same(rank["whole"]["weights"], whole["weights"])
        assert _same(rank["resumed"]["weights"], whole["weights"])
