"""Checkpoints saved by a release (``tests/data/``, made by ``tests/saved_runs.py``) load and resume bit for bit: the
residuals, the SGD momentum moved into the hook and Adam's moved moments are where the uninterrupted run had them."""

import pytest
import torch

from lightning_gravac.launch import run_distributed

from saved_runs import DATA, EXPECTED_KEY, SAVED_AT, fit


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["sgd_momentum", "adam_moments"])
def test_a_saved_checkpoint_resumes_to_the_uninterrupted_runs_weights_bit_for_bit(case):
    path = DATA / f"{case}.ckpt"
    saved = torch.load(path, weights_only=False)
    assert saved["global_step"] == SAVED_AT
    assert saved["gravac"]["residuals"] and (saved["gravac"]["momentum"] or saved["gravac"]["adam"])
    expected = saved[EXPECTED_KEY]
    for final in run_distributed(fit, case=case, ckpt_path=str(path), timeout=300):
        assert final.keys() == expected.keys()
        for name, w in expected.items():
            assert torch.equal(final[name], w), name
