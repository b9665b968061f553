"""docs/default.md, the default's rules in one table, quotes the constants the code holds: each quoted
``module:NAME = value`` must be what the module defines."""

import ast
import importlib
import re
from pathlib import Path

import pytest

TABLE = Path(__file__).resolve().parents[1] / "docs" / "default.md"
QUOTED = re.compile(r"`([\w.]+):(\w+) = ([^`]+)`")


def _quoted() -> list[tuple[str, str, str]]:
    return QUOTED.findall(TABLE.read_text())


def test_the_table_quotes_a_constant_for_each_rule_that_has_one():
    names = {name for _, name, _ in _quoted()}
    assert {"MIN_SAVING", "SGD_METHOD", "CLIPPED_METHOD", "ADAM_POLICY", "EMBEDDING_SHARE", "LENGTHS"} <= names


@pytest.mark.parametrize(("module", "name", "value"), _quoted(), ids=lambda v: str(v)[:40])
def test_each_quoted_constant_is_the_codes(module, name, value):
    assert getattr(importlib.import_module(module), name) == ast.literal_eval(value)
