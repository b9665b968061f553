"""The Accordion controller: scripted critical-regime detection and real 2-rank training."""

from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
from pytorch_lightning import Callback

from lightning_gravac import Accordion, GraVACStrategy, RunSummary, get_compressor
from lightning_gravac.launch import run_distributed
from lightning_gravac.state import CompressionState
from lightning_gravac.zoo import TeacherRegression

from models import loader, trainer_kwargs


def _accordion(**kwargs) -> Accordion:
    a = Accordion(**kwargs)
    a.compression_state = CompressionState(get_compressor("topk"), error_feedback=True)
    a.compressible = ["w"]
    a.layer_cf = {"w": a.low_cf, "b": 1.0}
    return a


def test_critical_when_the_accumulated_norm_changes_by_eta_or_more():
    a = _accordion(low_cf=2, high_cf=50, eta=0.5)
    decisions = []
    for norm in [10.0, 12.0, 24.0, 12.0, 11.0]:
        a.check({"w": norm})
        decisions.append(a.layer_cf["w"])
    # first interval critical; 20% change: not; 100%: critical; exactly 50%: critical (>= eta); 8%: not
    assert decisions == [2, 50, 2, 2, 50]
    assert a.layer_cf["b"] == 1.0  # 1-D: never compressed


def test_a_learning_rate_drop_sends_every_layer_back_to_light_until_the_next_check():
    a = _accordion(low_cf=2, high_cf=50, eta=0.5)
    a.check({"w": 10.0})
    a.check({"w": 10.5})
    a.apply(a.state)  # as at the end of every step
    assert a.layer_cf["w"] == 50

    def batch_start(lr: float) -> None:
        trainer = SimpleNamespace(optimizers=[SimpleNamespace(param_groups=[{"lr": lr}])], current_epoch=0)
        a.on_train_batch_start(trainer, None, None, 0)  # type: ignore[arg-type]

    batch_start(0.1)
    batch_start(0.1)
    assert a.layer_cf["w"] == 50 and a.state.param_cf["w"] == 50
    batch_start(0.01)
    assert a.layer_cf["w"] == 2 and a.state.param_cf["w"] == 2 and a.state.param_cf["b"] == 1.0
    a.check({"w": 10.6})  # the interval after the drop is critical, whatever its norm
    assert a.layer_cf["w"] == 2
    a.check({"w": 10.7})
    assert a.layer_cf["w"] == 50


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"low_cf": 100, "high_cf": 10}, r"`low_cf` \(100\) must not exceed `high_cf` \(10\)"),
        ({"high_cf": 0.5}, r"`high_cf` must be a finite number >= 1"),
        ({"eta": 0}, r"`eta` must be in \(0, 1\], got 0"),
        ({"window": 2.5}, r"`window` must be a whole number >= 1, got 2.5"),
        ({"interval": "batch"}, r"`interval` must be one of \('epoch', 'step'\), got 'batch'"),
    ],
)
def test_bad_options_are_value_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Accordion(**kwargs)


class LayerFactors(Callback):
    """Records the per-layer factors the hook will use, after every step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        self.steps.append(dict(trainer.strategy.compression_state.param_cf))


def _accordion_run(rank, world_size):
    pl.seed_everything(0)
    accordion = Accordion(low_cf=1, high_cf=20, eta=0.3, window=8, interval="step")
    factors, summary = LayerFactors(), RunSummary()
    trainer = pl.Trainer(strategy=GraVACStrategy("topk"), callbacks=[accordion, factors, summary], max_steps=96,
                         **trainer_kwargs(world_size))  # fmt: skip
    trainer.fit(TeacherRegression(width=128, lr=0.1), loader())
    return {"factors": factors.steps, "critical": [r["gravac/critical"] for r in summary.history],
            "achieved": [r["gravac/achieved_cf"] for r in summary.history]}  # fmt: skip


@pytest.mark.distributed
def test_ranks_on_different_data_make_the_same_per_layer_decisions():
    r0, r1 = run_distributed(_accordion_run)
    assert r0["factors"] == r1["factors"] and r0["critical"] == r1["critical"] and r0["achieved"] == r1["achieved"]
    assert r0["critical"][0] == 1.0, "the first interval is critical"
    assert min(r0["critical"]) < 1.0, "some layer should have left its critical regime"
    assert max(r0["achieved"]) > 1.5, "non-critical layers are compressed"
    for step in r0["factors"]:
        assert all(cf == 1.0 for name, cf in step.items() if name.endswith("bias")), "1-D parameters stay dense"
