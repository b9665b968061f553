"""lightning-gravac for the unified ``lightning`` package: ``import lightning as L``.

    import lightning as L
    from lightning_gravac.lightning import GraVACStrategy, GraVAC, Static

    L.Trainer(accelerator="cpu", devices=2, strategy=GraVACStrategy("topk"))

The same API as ``lightning_gravac``, built on ``lightning.pytorch`` instead of ``pytorch_lightning`` (Lightning's two
packages have distinct classes, so each ``Trainer`` needs its own strategy and callbacks); importing this package
registers ``"gravac"`` in ``lightning.pytorch``'s strategy registry. The modules next to this file are generated at
build from the Lightning-facing modules of ``lightning_gravac`` (``lightning_gravac/_mirror.py`` says how and why):
the strategy, the controllers, ``RunSummary``, ``MeProp``, the loggers and the models, under the same names
(``lightning_gravac.lightning.zoo``, ...). The parts that do not touch Lightning (the compressors, the hook's state,
error feedback, the divergence guard) are shared: import them from ``lightning_gravac`` (as attributes of this
package, ``lightning_gravac.lightning.compressors`` is ``lightning_gravac.compressors``); a compressor instance works
with either flavour.

Needs ``pip install lightning``. The command line (``python -m lightning_gravac``) and its recipes stay on
``pytorch_lightning``, the package's dependency.
"""

import importlib
import importlib.util
from types import ModuleType

try:
    import lightning.pytorch  # noqa: F401 - optional: its absence becomes the error below
except ImportError as error:
    raise ImportError(
        "lightning_gravac.lightning is built on the unified `lightning` package: `pip install lightning`, or import "
        "from `lightning_gravac` to use `pytorch_lightning`."
    ) from error

try:
    from lightning_gravac.lightning._package import *  # noqa: F403 - the API of lightning_gravac, for `lightning`
    from lightning_gravac.lightning._package import __all__, __version__  # noqa: F401 - this package's too
except ModuleNotFoundError as error:
    if error.name != f"{__name__}._package":
        raise
    raise ImportError(
        "lightning_gravac.lightning's modules are generated from the package's sources when it is installed: "
        "`pip install -e .`, or `python -m lightning_gravac._mirror` in a checkout."
    ) from error


def __getattr__(name: str) -> ModuleType:
    """A module of ``lightning_gravac`` that does not touch Lightning, asked for under this package: the shared module
    itself, never a second copy of it."""
    shared = f"lightning_gravac.{name}"
    if (
        not name.startswith("_")
        and importlib.util.find_spec(f"{__name__}.{name}") is None
        and importlib.util.find_spec(shared) is not None
    ):
        return importlib.import_module(shared)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
