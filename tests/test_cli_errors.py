"""A newcomer's mistakes are said in a line or two, naming what was wrong and what to write instead."""

import pytest

from lightning_gravac import GraVACStrategy


def test_a_strategy_argument_no_class_takes_is_refused_when_the_strategy_is_built():
    # Not at fit start, on every rank, in DistributedDataParallel's traceback.
    with pytest.raises(ValueError, match=r"takes no argument `cf`.*callbacks=\[Static\(cf=10\)\]"):
        GraVACStrategy(cf=10)
    with pytest.raises(ValueError, match=r"argument `find_unused_parameter`.*did you mean `find_unused_parameters`"):
        GraVACStrategy("topk", find_unused_parameter=True)
    # DDPStrategy's and DistributedDataParallel's own arguments still pass through.
    GraVACStrategy("topk", find_unused_parameters=True, bucket_cap_mb=5, static_graph=False, start_method="popen")
