"""Fully sharded training (FSDP2 through Lightning's ``ModelParallelStrategy``) with compressed gradients."""

from lightning_gravac.sharded.all_gather import CodedAllGather
from lightning_gravac.sharded.reduce_scatter import CodedReduceScatter
from lightning_gravac.sharded.strategy import GraVACModelParallelStrategy

__all__ = ["CodedAllGather", "CodedReduceScatter", "GraVACModelParallelStrategy"]
