"""Checkpoints saved by a release (``tests/data/``, made by ``tests/saved_runs.py``) load and resume to the
uninterrupted run's weights: the residuals, the SGD momentum moved into the hook and Adam's moved moments are where the
uninterrupted run had them.

That run's weights were computed on the machine that saved the files. A CPU whose kernels round differently (with
AVX-512 or without) ends 1-2 ulps away after the resumed steps (3e-8 measured), so the weights are compared within
1e-6: a resume without the residuals or the moved momentum ends 0.02-0.1 away. Resuming bit for bit on one machine is
tested where the checkpoint is made in the test (``test_gravac.py``, ``test_local_steps.py``)."""

import pytest
import torch

from lightning_gravac.launch import run_distributed

from saved_runs import DATA, EXPECTED_KEY, SAVED_AT, fit


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["sgd_momentum", "adam_moments"])
def test_a_saved_checkpoint_resumes_to_the_uninterrupted_runs_weights(case):
    path = DATA / f"{case}.ckpt"
    saved = torch.load(path, weights_only=False)
    assert saved["global_step"] == SAVED_AT
    assert saved["gravac"]["residuals"] and (saved["gravac"]["momentum"] or saved["gravac"]["adam"])
    expected = saved[EXPECTED_KEY]
    for final in run_distributed(fit, case=case, ckpt_path=str(path), timeout=300):
        assert final.keys() == expected.keys()
        for name, w in expected.items():
            torch.testing.assert_close(final[name], w, rtol=0, atol=1e-6, msg=name)
