"""The static controller: one factor for the whole run."""

from lightning_gravac.callbacks.controller import Controller
from lightning_gravac.compressors.base import validate_cf

#: Factor of the controller GraVACStrategy adds when the trainer has none.
DEFAULT_CF = 10.0


class Static(Controller):
    """Compress every step at the same factor: the baseline adaptive controllers are measured against.

    Args:
        cf: compression factor, dense bytes / sent bytes; 1 is plain DDP. Default 10, GraVAC's starting factor.
        cap_to_model: lower ``cf`` at setup to the size of the model's largest trainable tensor, where that is smaller,
            instead of refusing the model. ``GraVACStrategy`` installs its default controller so for a method whose
            size its encoding fixes (a 16-bit cast, signs): a frozen backbone under a small head is a valid model.

    Raises:
        ValueError: if ``cf`` is not a finite number >= 1.

    Example::

        Trainer(strategy=GraVACStrategy(compressor="topk"), callbacks=[Static(cf=100)])
    """

    def __init__(self, cf: float = DEFAULT_CF, cap_to_model: bool = False) -> None:
        super().__init__(cf=validate_cf(cf))
        self._caps = cap_to_model
        self._asked = self.cf

    def fit_to_model(self, largest: int) -> None:
        """With ``cap_to_model``, the factor asked for, or the largest trainable tensor's size if that is smaller."""
        if self._caps and largest >= 1:
            self.cf = min(self._asked, float(largest))

    def __repr__(self) -> str:
        return f"Static(cf={self.cf}, cap_to_model=True)" if self._caps else super().__repr__()
