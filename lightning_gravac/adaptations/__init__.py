"""What the comm hook carries from one step to the next: error feedback's residuals and the optimizer adaptations.

:class:`Carry` stores and drops them (the residuals and moved buffers are written by this package's code alone);
:func:`encode` is the one sequence of error feedback, compression and residual that the communicators and the
benchmarks share. An optimizer adaptation is one module registering an :class:`Adaptation`, imported below.
"""

from lightning_gravac.adaptations.adaptation import Adaptation, Setup, register_adaptation
from lightning_gravac.adaptations.momentum import MomentumCorrection, SGDMomentum, masking_retention  # isort: split

from lightning_gravac.adaptations.adam import AdamMoments, scales_per_coordinate  # isort: split

from lightning_gravac.adaptations.local_steps import LocalSteps, OuterUpdate  # isort: split

from lightning_gravac.adaptations.carry import Carry
from lightning_gravac.adaptations.residuals import Encoded, ErrorFeedback, ResidualMode, encode
from lightning_gravac.adaptations.round_guard import LocalStepsDiverged
from lightning_gravac.staged import Staged

__all__ = [
    "AdamMoments",
    "Adaptation",
    "Carry",
    "Encoded",
    "ErrorFeedback",
    "LocalSteps",
    "LocalStepsDiverged",
    "MomentumCorrection",
    "OuterUpdate",
    "ResidualMode",
    "SGDMomentum",
    "Setup",
    "Staged",
    "encode",
    "masking_retention",
    "register_adaptation",
    "scales_per_coordinate",
]
