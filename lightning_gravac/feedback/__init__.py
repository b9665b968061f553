"""What the comm hook carries from one step to the next: error feedback's residuals and the optimizer's moved moments.

:class:`Feedback` stores and drops them (the residuals and moved buffers are written by this package's code alone);
:func:`encode` is the one sequence of error feedback, compression and residual that the communicators and the
benchmarks share.
"""

from lightning_gravac.feedback.adam import AdamMoments
from lightning_gravac.feedback.feedback import Feedback
from lightning_gravac.feedback.momentum import MomentumCorrection, SGDMomentum, masking_retention
from lightning_gravac.feedback.residuals import Encoded, ErrorFeedback, FeedMode, encode

__all__ = [
    "AdamMoments",
    "Encoded",
    "ErrorFeedback",
    "FeedMode",
    "Feedback",
    "MomentumCorrection",
    "SGDMomentum",
    "encode",
    "masking_retention",
]
