"""Lightning's two packages, and the package of ours built on each: what a Trainer of one says when given the other's.

``pytorch_lightning`` and the unified ``lightning`` (``lightning.pytorch``) hold distinct classes, so a strategy or a
callback of ``lightning_gravac`` (built on the first) is refused by ``lightning.Trainer``, and one of
``lightning_gravac.lightning`` (the second) by ``pytorch_lightning.Trainer``. Lightning's own refusal ("You selected
an invalid strategy name") does not say that the other flavour exists; these say it, in one line.

Never written again for the ``lightning`` flavour (``_mirror.NOT_MIRRORED``): both flavours read these names as they
are, where the mirror would read ``pytorch_lightning`` here as ``lightning.pytorch``.
"""

import sys

#: Each Lightning package, with the package of ours built on it.
OURS = {"pytorch_lightning": "lightning_gravac", "lightning.pytorch": "lightning_gravac.lightning"}


def other(package: str) -> str:
    """The Lightning package that is not ``package`` (one of :data:`OURS`)."""
    (the_other,) = set(OURS) - {package}
    return the_other


def mixed_up(name: str, built_on: str) -> ValueError:
    """The error for ``name`` (a class of ours built on ``built_on``) given to the other package's Trainer."""
    trainer = other(built_on)
    return ValueError(
        f"{name} from `{OURS[built_on]}` is built on `{built_on}`, but this Trainer is `{trainer}`'s: "
        f"use `from {OURS[trainer]} import {name}`."
    )


def visible_to_the_other_trainer(strategy: type, built_on: str) -> None:
    """Make the other package's ``Trainer`` (when that package is imported) take a ``strategy`` instance, so that the
    strategy can refuse it with :func:`mixed_up`'s line when the Trainer configures it, instead of Lightning's generic
    "invalid strategy name": Lightning checks ``isinstance(strategy, Strategy)`` before calling anything of it, and
    its ``Strategy`` is an abstract base class, which takes registered classes."""
    strategies = sys.modules.get(f"{other(built_on)}.strategies")
    if strategies is not None:
        strategies.Strategy.register(strategy)
