"""Issue #49: every built-in plan's layout table is made of one named row type,
streamck.plan.contract.Row, read by name: a Row is no tuple, so an index read fails (the
families' own tests check what the rows convert)."""

from __future__ import annotations

import importlib

import pytest

from streamck.plan.contract import Row

# The layout modules whose tables are Rows (streamck/plan/megatron's tables are its own, for now).
LAYOUTS = [
    "torchtitan.layout",
    "torchtitan.deepseek_layout",
    "olmo2.layout",
    "eagle3.layout",
    "eagle4.layout",
]


def _row_like(value: object) -> bool:
    """A Row, or a tuple shaped like the positional rows Row replaced: (name, name, shape, …)."""
    return isinstance(value, Row) or (
        isinstance(value, tuple)
        and len(value) >= 3
        and isinstance(value[0], str)
        and isinstance(value[1], str)
        and isinstance(value[2], tuple)
    )


def _rows(value: object) -> list[object] | None:
    """The rows of a tensor table (a row, a tuple of rows, a dict of them), or None for other data."""
    if _row_like(value):
        return [value]
    if isinstance(value, dict) and value:
        found = [_rows(v) for v in value.values()]
        return None if None in found else [r for rows in found for r in rows]
    if isinstance(value, tuple) and value and all(_row_like(v) for v in value):
        return list(value)
    return None


@pytest.mark.parametrize("module", LAYOUTS)
def test_every_tensor_table_is_rows(module):
    """Every tensor table of a family's layout holds Rows: no positional tuple is left."""
    layout = importlib.import_module(f"streamck.plan.{module}")
    tables = {n: _rows(v) for n, v in vars(layout).items() if n.isupper() and _rows(v) is not None}
    assert tables, module
    assert {n: rows for n, rows in tables.items() if not all(isinstance(r, Row) for r in rows)} == {}


def test_the_check_sees_a_positional_table():
    assert _rows((("a.weight", "b.weight", ("H",)),)) == [("a.weight", "b.weight", ("H",))]
    assert _rows({"x": (Row("a", "b", ("H",)),)}) == [Row("a", "b", ("H",))]
    assert _rows(("a", "b")) is None and _rows({"k": (True, False)}) is None


def test_a_row_fills_its_names_and_picks_the_legacy_name():
    row = Row("model.layers.{i}.q.weight", "layers.{i}.wq", ("nh*d", "H"), permute="q", legacy="old.{i}.wq")
    at = row.at(i=3)
    assert (at.out, at.src, at.legacy, at.shape, at.permute) == (
        "model.layers.3.q.weight",
        "layers.3.wq",
        "old.3.wq",
        ("nh*d", "H"),
        "q",
    )
    assert (at.source(), at.source(legacy=True)) == ("layers.3.wq", "old.3.wq")
    plain = Row("norm.weight", "norm.weight", ("H",))
    assert plain.source(legacy=True) == "norm.weight"  # no legacy name: the same in both versions
    with pytest.raises(TypeError):  # read by name only: a Row is not a tuple
        row[0]
