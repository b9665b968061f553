"""A data set that is neither on disk nor downloadable, and one decision about it on every rank."""

from typing import Any


class MissingData(FileNotFoundError, ConnectionError):
    """A data set that cannot be found or fetched. Its message is one line: what is missing, where to put it, and
    ``synthetic: true``. The command line prints it on rank 0 alone and every rank exits with status 1 (no traceback).
    A ``FileNotFoundError`` (nothing on disk) and a ``ConnectionError`` (nothing downloadable) both."""


def raise_on_every_rank(trainer: Any, missing: MissingData | None) -> None:
    """Raise ``missing`` where some rank has it, on every rank of ``trainer`` (a Lightning ``Trainer``, or ``None``)
    alike, with rank 0's message where it has one: a rank that went on alone would wait in the next collective for
    ranks that are gone. Every rank must call it. Written against either Lightning package: it names neither."""
    if trainer is None or trainer.world_size == 1:
        if missing is not None:
            raise missing
        return
    strategy = trainer.strategy
    message = strategy.broadcast(None if missing is None else str(missing))
    if strategy.reduce_boolean_decision(missing is not None, all=False):
        raise MissingData(message or str(missing or "a rank's data set is missing; see that rank's files"))
