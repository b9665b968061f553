"""A newcomer's mistakes are said in a line or two, naming what was wrong and what to write instead: a strategy argument
no class takes, a recipe override the parser rejects or that is not ``key=value``, ``run`` without a recipe, and a
summary whose metric was never measured because no validation ran."""

import pytest

from lightning_gravac import GraVACStrategy, RunSummary
from lightning_gravac.cli import _dispatch, run_recipe


def test_a_strategy_argument_no_class_takes_is_refused_when_the_strategy_is_built():
    # Not at fit start, on every rank, in DistributedDataParallel's traceback.
    with pytest.raises(ValueError, match=r"takes no argument `cf`.*callbacks=\[Static\(cf=10\)\]"):
        GraVACStrategy(cf=10)
    with pytest.raises(ValueError, match=r"argument `find_unused_parameter`.*did you mean `find_unused_parameters`"):
        GraVACStrategy("topk", find_unused_parameter=True)
    # DDPStrategy's and DistributedDataParallel's own arguments still pass through.
    GraVACStrategy("topk", find_unused_parameters=True, bucket_cap_mb=5, static_graph=False, start_method="popen")


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("trainer.max_step=5", "lightning_gravac: quickstart: no key 'trainer.max_step' (check its spelling)"),
        ("model.init_args.widht=3", "lightning_gravac: quickstart: TeacherRegression takes no argument 'widht'"),
        ("trainer.max_steps=five", 'lightning_gravac: quickstart: Parser key "trainer.max_steps"'),
    ],
    ids=["unknown-key", "unknown-argument", "wrong-type"],
)
def test_a_recipe_override_the_parser_rejects_is_said_without_lightnings_usage(override, said):
    with pytest.raises(SystemExit) as exited:
        run_recipe(["quickstart", override])
    message = str(exited.value.code)
    assert message.startswith(said) and "usage:" not in message and "--trainer" not in message, message
    assert message.endswith("python -m lightning_gravac fit --help") and len(message.splitlines()) <= 3, message


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["quickstart", "trainer.max_steps"], "lightning_gravac: 'trainer.max_steps' has no `=value`"),
        (["quickstart", "trainer.devices=[1"], "lightning_gravac: The value of 'trainer.devices=[1' is read as yaml"),
        (["quickstart", "quick=maybe"], "lightning_gravac: `quick` is true or false, got 'maybe'"),
    ],
    ids=["no-value", "not-yaml", "quick"],
)
def test_an_override_that_is_not_key_value_is_said_in_one_line(argv, said):
    with pytest.raises(SystemExit) as exited:
        run_recipe(argv)
    assert str(exited.value.code).startswith(said) and "\n" not in str(exited.value.code), exited.value.code


def test_run_without_a_recipe_says_it_takes_one_first():
    for argv in (["run"], ["run", "trainer.max_steps=5"]):
        with pytest.raises(SystemExit) as exited:
            _dispatch(argv)
        first = str(exited.value.code).splitlines()[0]
        assert first.startswith("run takes a recipe first: a packaged one (lstm_ptb, quickstart"), first


def test_the_summary_says_no_validation_ran_where_the_module_validates_and_none_did():
    summary = RunSummary(monitor="val_acc")
    summary.history = [{"step": 1.0 + i, "gravac/cf": 10.0, "gravac/bytes_sent": 10.0, "gravac/bytes_dense": 100.0}
                       for i in range(3)]  # fmt: skip
    summary.logged, summary.validates_every = ["train_loss"], 781.0
    table = summary.table(1.0)
    assert "No metric named 'val_acc' was logged (logged: train_loss), and no validation ran in these 3 steps" in table
    assert "every 781 training batches" in table and "trainer.val_check_interval" in table
    assert "give RunSummary(monitor=...)" not in table
    summary.validates_every = None  # validation ran, or the module has none: the name is the question
    assert "give RunSummary(monitor=...) the name the module logs" in summary.table(1.0)
