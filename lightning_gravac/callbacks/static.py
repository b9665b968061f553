"""The static controller: one factor for the whole run."""

from lightning_gravac.callbacks.controller import Controller
from lightning_gravac.compressors.base import validate_cf

#: Factor of the controller GraVACStrategy adds when the trainer has none.
DEFAULT_CF = 10.0


class Static(Controller):
    """Compress every step at the same factor: the baseline adaptive controllers are measured against.

    Args:
        cf: compression factor, dense bytes / sent bytes; 1 is plain DDP. Default 10, GraVAC's starting factor.

    Raises:
        ValueError: if ``cf`` is not a finite number >= 1.

    Example::

        Trainer(strategy=GraVACStrategy(compressor="topk"), callbacks=[Static(cf=100)])
    """

    def __init__(self, cf: float = DEFAULT_CF) -> None:
        super().__init__(cf=validate_cf(cf))
