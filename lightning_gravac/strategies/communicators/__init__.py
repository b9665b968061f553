"""The communicators: how one bucket crosses the network, one per pattern.

The comm hook (:mod:`lightning_gravac.strategies.hook`) prepares a bucket as a :class:`Work` (its segments: each layer,
or the whole bucket; their factors and methods; the step's own-gradient probes) and hands it to
:func:`communicator_for`. Buckets that are not compressed (:mod:`.dense`): :class:`LocalSGD` (nothing sent),
:class:`SparseReduced` (a sparse gradient's all-reduce), :class:`Plain` (stock DDP's all-reduce, bit for bit) and
:class:`RowsReduced` (the same sum, of embedding tables by the rows their step touched). The compressed ones, by the
method's :class:`~lightning_gravac.compressors.base.Pattern`:

- :class:`Gathered` (``GATHER``, :mod:`.one_round`): error feedback, compression and residuals (:func:`encode`), then
  an all-gather of the packed payloads and the header, decoded rank by rank in rank order; or, when the gather would
  move more bytes than a ring all-reduce of the dense bucket, the payloads decoded locally and the bucket all-reduced
  with the header.
- :class:`Summed` (``SUM``, :mod:`.one_round`): the same encoding; the payloads all-reduced element-wise (they share
  support), decoded once.
- :class:`InRounds` (``ROUNDS``, :mod:`.in_rounds`): a method's successive all-reduces
  (:class:`~lightning_gravac.compressors.rounds.MultiRound`), the first with the segments sent dense, the last with
  the header.
- :class:`DenseProbed` (:mod:`.dense`): every factor 1 but the controller measures what compression would keep: the
  dense bucket all-reduced with the header (residuals are sent in full and dropped).

A layer or bucket sent dense under a method with momentum of its own (DGC) holds what the method delivers there
(``Work.delivered``, prepared by the hook); the method's new state is committed or discarded by :func:`settle`.

Each compressed communicator builds the bucket's :class:`Header` (this rank's norms, summed over ranks by a
collective). Every communicator ends in :func:`settle` (:mod:`.settle`): a finite step commits the method's state and
the carry stores the pending residuals and momentum; a non-finite one (some rank's gradient was not) discards
them (and a compressed bucket is poisoned with NaN); the bucket's :class:`~lightning_gravac.state.BucketRecord` is
recorded, with the :class:`~lightning_gravac.state.Collective` the bucket took.

Two rules keep the collectives from hanging. Every collective is launched from the thread that runs the hook, so
every rank issues them in the same order (collectives are matched by that order; a collective launched from a
future's callback, which runs on whichever thread completes the previous one, would not be). And no callback waits
for anything: callbacks only decode and record.
"""

from lightning_gravac.compressors.base import Pattern
from lightning_gravac.strategies.communicators.communicator import Communicator
from lightning_gravac.strategies.communicators.dense import DenseProbed, LocalSGD, Plain, RowsReduced, SparseReduced
from lightning_gravac.strategies.communicators.header import Header
from lightning_gravac.strategies.communicators.in_rounds import InRounds
from lightning_gravac.strategies.communicators.one_round import Gathered, OneRound, Summed
from lightning_gravac.strategies.communicators.settle import land, reduce_with_header, settle
from lightning_gravac.strategies.communicators.work import PlainSend, Segment, Work

_BY_PATTERN: dict[Pattern, Communicator] = {
    Pattern.GATHER: Gathered(),
    Pattern.SUM: Summed(),
    Pattern.ROUNDS: InRounds(),
}
_DENSE_PROBED, _PLAIN, _ROWS, _SPARSE, _LOCAL_SGD = DenseProbed(), Plain(), RowsReduced(), SparseReduced(), LocalSGD()


def communicator_for(work: Work) -> Communicator:
    """The communicator of a bucket: nothing sent under local SGD; a sparse gradient's all-reduce; stock DDP's
    all-reduce (of embedding tables by their touched rows, where some are); dense with probes; a method's rounds; the
    all-reduce of payloads when every segment's are summable (a layer sent dense is); else the gather."""
    if work.local_sgd:
        return _LOCAL_SGD
    if work.buffer.is_sparse:
        return _SPARSE
    if work.plain is not None:
        return _ROWS if work.plain.rows or work.plain.half else _PLAIN
    if work.dense_probed:
        return _DENSE_PROBED
    if work.method.communication is Pattern.ROUNDS:
        return _BY_PATTERN[Pattern.ROUNDS]
    # `summable` rather than the declared pattern: a method that sets `summable = True` itself is summed as before.
    summed = all(s.compressor.summable for s in work.segments)
    return _BY_PATTERN[Pattern.SUM if summed else Pattern.GATHER]


__all__ = [
    "Communicator",
    "DenseProbed",
    "Gathered",
    "Header",
    "InRounds",
    "LocalSGD",
    "OneRound",
    "Plain",
    "PlainSend",
    "RowsReduced",
    "Segment",
    "SparseReduced",
    "Summed",
    "Work",
    "communicator_for",
    "land",
    "reduce_with_header",
    "settle",
]
