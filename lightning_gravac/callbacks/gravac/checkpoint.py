"""GraVAC's checkpoint: each of its parts declares the fields checkpoints hold (:func:`checkpointed`), and
:class:`Checkpointed` saves and restores them by name. The controller writes every part's fields into one flat dict, in
:data:`CHECKPOINT_ORDER`."""

from collections.abc import Callable
from dataclasses import MISSING, Field, asdict, fields, is_dataclass
from typing import Any

#: The checkpointed fields in the order checkpoints hold them, which the first version set: their bytes stay the same.
CHECKPOINT_ORDER = (
    "cf_min", "candidate", "scale", "settled", "gains", "throughput", "link", "windows", "progress", "steps",
    "last_probe", "probe_interval", "tally", "gain_of", "gain_sums", "compress_cost", "cast_cost", "payload_fixed",
    "buckets",
)  # fmt: skip


def checkpointed(*, added: bool = False, restore: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """The metadata of a part's field (a dataclass field) that checkpoints carry under its name:
    ``field(default=0, metadata=checkpointed())``.

    Args:
        added: checkpoints of earlier versions lack it: loading one of them gives it its fresh value
            (:meth:`Checkpointed.fresh`); a field that every version saved must be there.
        restore: the value from what :meth:`Checkpointed.state_dict` saved (plain dicts and lists); ``None``: as saved.
    """
    return {"checkpointed": True, "added": added, "restore": restore}


def _plain(value: Any) -> Any:
    """``value`` as a checkpoint holds it: a dataclass as a dict, a tuple as a list, a dict's values alike."""
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return list(value)
    return value


class Checkpointed:
    """A part of GraVAC, a dataclass whose :func:`checkpointed` fields checkpoints hold."""

    def _checkpointed(self) -> list[Field[Any]]:
        part: Any = self
        return [f for f in fields(part) if f.metadata.get("checkpointed")]

    def state_dict(self) -> dict[str, Any]:
        """Each checkpointed field by its name, as plain values."""
        return {f.name: _plain(getattr(self, f.name)) for f in self._checkpointed()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore the checkpointed fields from ``saved`` (a checkpoint's flat dict, which holds other parts' too).

        Raises:
            KeyError: for a field that every version saved, missing from ``saved``.
        """
        for f in self._checkpointed():
            if f.name in saved:
                restore = f.metadata["restore"]
                setattr(self, f.name, saved[f.name] if restore is None else restore(saved[f.name]))
            elif f.metadata["added"]:
                setattr(self, f.name, self.fresh(f, saved))
            else:
                raise KeyError(f.name)

    def fresh(self, f: Field[Any], saved: dict[str, Any]) -> Any:
        """The value of the added field ``f`` when a checkpoint (``saved``) lacks it: its default."""
        return f.default_factory() if f.default_factory is not MISSING else f.default
