"""What a run says at fit start reads in one line: the factors named as what they are, a loopback not taken for a
network."""

from types import SimpleNamespace

from lightning_gravac.callbacks.gravac.ladder import Ladder
from lightning_gravac.callbacks.gravac.link_timer import loopback_note


def test_the_factors_said_at_fit_start_say_what_a_factor_is(caplog):
    ladder = Ladder.between(10.0, 1000.0, "exponential", {"cf_min": True, "cf_max": True})
    with caplog.at_level("INFO"):
        assert ladder.fit_bounds((3.97, 15.5), largest=1 << 20, method="qsgd")
    (said,) = [r.getMessage() for r in caplog.records]
    assert said.startswith("GraVAC: the factors it chooses among when it compresses: cf 3.97, 7.94, 15.5 (")
    assert "a factor is dense bytes over bytes sent; 'qsgd' sends from 3.97 to 15.5" in said


def test_a_link_within_one_machine_is_said_to_be_a_loopback():
    note = loopback_note(SimpleNamespace(num_nodes=1))
    assert "a loopback, not a network" in note and "load" in note
    assert loopback_note(SimpleNamespace(num_nodes=2)) == ""
