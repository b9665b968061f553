"""The protocol of an optimizer adaptation: a part declares its state once, and the `Carry` that holds it, the guard's
reset, the gradient scale and the checkpoint (on any number of ranks) follow from the declaration."""

import torch
from torch import Tensor

from lightning_gravac import get_compressor
from lightning_gravac.adaptations import AdamMoments, Carry, MomentumCorrection, OuterUpdate, Setup, Staged, adaptation
from lightning_gravac.adaptations.adaptation import Adaptation, register_adaptation
from lightning_gravac.state import CompressionState
from lightning_gravac.strategies.checkpoint import restore_compression, saved_compression


class _Trace(Adaptation):
    """A toy part: each rank's running sum of its gradients, committed on finite steps."""

    name = "trace"

    def __init__(self) -> None:
        super().__init__()
        self.sums: Staged
        self.add_state("sums", "s", gradient_units=True)

    def __bool__(self) -> bool:
        return True

    def before_compression_(self, names: list[str], grads: list[Tensor], params: list[Tensor]) -> None:
        for name, grad in zip(names, grads, strict=True):
            old = self.sums.kept.get(name)
            self.sums.stage(name, grad.clone() if old is None else old + grad)

    def settle(self, names, pending, finite, averaged, params, exact) -> None:
        (self.sums.commit if finite else self.sums.discard)(names)


def test_the_registered_parts_are_sgd_momentum_adams_moments_and_the_outer_update_in_that_order():
    assert [type(p) for p in Carry().adaptations] == [MomentumCorrection, AdamMoments, OuterUpdate]


def test_a_part_is_one_class_and_one_registration(monkeypatch):
    monkeypatch.setattr(adaptation, "_REGISTRY", list(adaptation._REGISTRY))
    register_adaptation(_Trace)
    carry = Carry()
    trace = carry.get(_Trace)
    carry.before_compression_(["w"], [torch.ones(3)], [])
    carry.settle(["w"], {}, finite=False)  # a non-finite step keeps nothing
    assert trace.sums.kept == {}
    for _ in range(2):
        carry.before_compression_(["w"], [torch.ones(3)], [])
        carry.settle(["w"], {}, finite=True)
    assert torch.equal(trace.sums.kept["w"], torch.full((3,), 2.0))
    carry.rescale_(0.5)  # declared in gradient units
    assert torch.equal(trace.sums.kept["w"], torch.ones(3))
    (key, saved_sum), *_ = carry.state_dict()["trace"].items()
    assert key == "s/w" and torch.equal(saved_sum, torch.ones(3))
    # The checkpoint: saved stacked by rank (one here), restored on as many ranks and on another number.
    state = CompressionState(get_compressor("topk"), error_feedback=True, carry=carry)
    saved = saved_compression(state, world_size=1)
    assert saved["trace"]["s/w"].shape == (1, 3)
    saved["trace"]["s/w"] = torch.stack([torch.ones(3), torch.full((3,), 3.0)])
    saved["world_size"] = 2
    restore_compression(state, saved, world_size=1, rank=0, device=torch.device("cpu"))
    assert torch.equal(trace.sums.kept["w"], torch.full((3,), 2.0))  # the mean of the saved ranks
    carry.reset()  # declared dropped by the divergence guard
    assert trace.sums.kept == {} and carry.state_dict()["trace"] == {}


def test_a_state_some_rank_did_not_have_is_restored_as_none_there_and_resharded_by_what_it_means(monkeypatch):
    monkeypatch.setattr(adaptation, "_REGISTRY", list(adaptation._REGISTRY))
    register_adaptation(_Trace)
    carry = Carry()
    state = CompressionState(get_compressor("topk"), error_feedback=True, carry=carry)
    saved = saved_compression(state, world_size=1)
    # Saved on 3 ranks: rank 1 had neither a residual of `w` nor a running sum of it (its rows are the gather's zeros).
    rows = torch.stack([torch.full((2,), 3.0), torch.zeros(2), torch.full((2,), 6.0)])
    saved.update(world_size=3, residuals={"w": rows}, trace={"s/w": rows.clone()})
    saved["absent"] = {"residuals": {"w": [1]}, "trace": {"s/w": [1]}}
    trace = carry.get(_Trace)
    restore_compression(state, saved, world_size=3, rank=1, device=torch.device("cpu"))
    assert "w" not in carry.residuals and "w" not in trace.sums.kept  # on as many ranks: none, as it had
    restore_compression(state, saved, world_size=3, rank=2, device=torch.device("cpu"))
    assert torch.equal(carry.residuals.get("w"), torch.full((2,), 6.0)) and torch.equal(trace.sums.kept["w"], rows[2])
    # On another number: a residual is what a rank owed, none for rank 1, so the mean counts its zeros in and the
    # ranks still owe the same in sum; a state that is not owed is the mean of the ranks that had it.
    restore_compression(state, saved, world_size=2, rank=0, device=torch.device("cpu"))
    assert torch.equal(carry.residuals.get("w"), torch.full((2,), 3.0))
    assert torch.equal(trace.sums.kept["w"], torch.full((2,), 4.5))


def test_a_checkpoint_without_a_parts_entry_restores_it_empty():
    carry = Carry()
    carry.load_state_dict({"residuals": {}})
    assert carry.get(MomentumCorrection).state_dict() == {} and carry.get(AdamMoments).frozen_from is None
    assert Setup([], {}).sparse == frozenset()
