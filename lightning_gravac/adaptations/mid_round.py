"""What a rank of local steps keeps of its own round: the inner optimizer's state as the round began, for the guard to
undo the round, and what a checkpoint saved mid-round carries for this rank alone.

Within a round the ranks' parameters and inner optimizer states differ; Lightning's checkpoint holds rank 0's. Each
rank's own are saved beside it (stacked by rank with the strategy's state) and restored over Lightning's once it has
restored its own, so that a run resumed mid-round goes on bit for bit.
"""

import copy
from typing import Any, TypeGuard

import torch
from torch import Tensor, nn


class MidRound:
    """This rank's own round (see the module's docstring).

    State, this rank's own: the inner optimizer's state as the round began (kept only with the guard: one more copy of
    the optimizer's state) and, from a checkpoint until the fit starts, the parameters and inner state it saved.
    """

    def __init__(self) -> None:
        self._params: dict[str, nn.Parameter] = {}
        self._optimizer: torch.optim.Optimizer | None = None
        self._began: dict[str, dict[str, Any]] = {}  # this rank's inner optimizer state as the round began
        self._resumed: dict[str, Tensor] = {}  # this rank's parameters and inner state, for after Lightning's restore

    def take_from(self, params: dict[str, nn.Parameter], optimizer: torch.optim.Optimizer) -> None:
        """This rank's parameters, by name, and the inner optimizer."""
        self._params, self._optimizer = params, optimizer

    def keep(self) -> None:
        """A round begins: the inner optimizer's state as it is, written over what the last round's start kept."""
        if self._optimizer is None:
            return
        state = self._optimizer.state
        self._began = {
            name: _copied(state[p], into=self._began.get(name)) for name, p in self._params.items() if state.get(p)
        }

    def restore(self) -> None:
        """The inner optimizer's state as the round began (a parameter that had none then has none again), written
        into the optimizer's own tensors where they fit."""
        if self._optimizer is None:
            return
        for name, p in self._params.items():
            kept = self._began.get(name)
            if kept is None:
                self._optimizer.state.pop(p, None)
            else:
                self._optimizer.state[p] = _copied(kept, into=self._optimizer.state.get(p))

    @property
    def resumed(self) -> bool:
        """Whether a checkpoint's state for this rank waits for :meth:`restore_rank`."""
        return bool(self._resumed)

    def state_dict(self) -> dict[str, Tensor]:
        """This rank's inner state as the round began, its parameters and inner state now. Not copied: the strategy
        gathers every rank's into a tensor of its own before anything steps."""
        state: dict[str, Tensor] = {}
        for name, kept in self._began.items():
            for key, value in kept.items():
                if isinstance(value, Tensor):
                    state[f"began_inner/{name}/{key}"] = value
        for name, p in self._params.items():
            state[f"params/{name}"] = p.detach()
        if self._optimizer is not None:
            for name, p in self._params.items():
                for key, value in self._optimizer.state.get(p, {}).items():
                    if isinstance(value, Tensor):
                        state[f"inner/{name}/{key}"] = value.detach()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take this rank's entries of a checkpoint, restored by :meth:`restore_rank` after Lightning's restore."""
        self._resumed = {k: v for k, v in state.items() if k.startswith(("params/", "inner/", "began_inner/"))}

    def restore_rank(self) -> None:
        """This rank's own parameters and inner optimizer state, saved mid-round (Lightning restored rank 0's)."""
        began: dict[str, dict[str, Tensor]] = {}
        inner: dict[str, dict[str, Tensor]] = {}
        with torch.no_grad():
            for key, value in self._resumed.items():
                kind, rest = key.split("/", 1)
                if kind == "params" and rest in self._params:
                    self._params[rest].copy_(value)
                elif kind in ("began_inner", "inner"):
                    name, slot = rest.rsplit("/", 1)
                    if name in self._params:
                        (began if kind == "began_inner" else inner).setdefault(name, {})[slot] = value
            if self._optimizer is not None and any(k.startswith("params/") for k in self._resumed):
                # Lightning restored rank 0's optimizer state on every rank: each parameter's becomes this rank's own,
                # none where this rank had none (it had skipped every step so far as non-finite).
                for name, p in self._params.items():
                    if name not in inner:
                        self._optimizer.state.pop(p, None)
                        continue
                    live = self._optimizer.state[p]
                    for slot, value in inner[name].items():
                        held = live.get(slot)
                        if isinstance(held, Tensor) and held.shape == value.shape:
                            held.copy_(value)  # in place: the optimizer's own tensor
                        else:
                            live[slot] = _placed(value, p)
            self._began = {name: self._kept_as_saved(name, slots) for name, slots in began.items()}
        self._resumed = {}

    def _kept_as_saved(self, name: str, saved: dict[str, Tensor]) -> dict[str, Any]:
        """Parameter ``name``'s inner state as its round began, from a checkpoint's tensors (``saved``): each on the
        device and in the dtype the optimizer holds that slot in (Adam's step count stays on the CPU), its other
        slots (not tensors) as the optimizer holds them now."""
        live = self._optimizer.state.get(self._params[name], {}) if self._optimizer is not None else {}
        kept: dict[str, Any] = {k: copy.deepcopy(v) for k, v in live.items() if not isinstance(v, Tensor)}
        for slot, value in saved.items():
            held = live.get(slot)
            if isinstance(held, Tensor) and held.shape == value.shape:
                kept[slot] = held.detach().clone().copy_(value)
            else:
                kept[slot] = _placed(value, self._params[name])
        return kept


def _copied(state: dict[str, Any], into: dict[str, Any] | None = None) -> dict[str, Any]:
    """One parameter's optimizer state, copied: each tensor into ``into``'s of that slot where it fits, else cloned."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(value, Tensor):
            out[key] = copy.deepcopy(value)
            continue
        held = None if into is None else into.get(key)
        if _fits(held, value):
            out[key] = held.copy_(value)
        else:
            out[key] = value.detach().clone()
    return out


def _fits(held: Any, value: Tensor) -> TypeGuard[Tensor]:
    """Whether ``held`` is another tensor that ``value`` can be copied into exactly."""
    return (
        isinstance(held, Tensor)
        and held is not value
        and (held.shape, held.dtype, held.device) == (value.shape, value.dtype, value.device)
    )


def _placed(value: Tensor, param: Tensor) -> Tensor:
    """A saved optimizer slot the live state lacks, where torch's optimizers keep it: a step count (a scalar) on the
    CPU (unless capturable or fused; untested on CUDA here: no GPU), any other with its parameter."""
    return value.cpu().clone() if value.dim() == 0 else value.to(param.device)
