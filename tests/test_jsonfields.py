"""The JSON field validator shared by the cluster file and the plan: paths, forms of message."""

from __future__ import annotations

from typing import Any

import pytest

from autoplan.errors import PlanFormatError
from autoplan.jsonfields import JsonField


def _doc(value: Any) -> JsonField:
    return JsonField(value, "doc.json", PlanFormatError, hint="see the README")


def test_paths_name_keys_and_list_indices() -> None:
    doc = _doc({"nodes": {"a": {"inputs": [{"tp": "R"}, {"tp": 3}]}}})
    second = doc["nodes"]["a"]["inputs"].elements()[1]["tp"]
    with pytest.raises(
        PlanFormatError,
        match=r"^doc\.json: field nodes\.a\.inputs\[1\]\.tp must be a string, got 3$",
    ):
        second.text()


@pytest.mark.parametrize(
    ("read", "message"),
    [
        (lambda d: d["gone"], r"^doc\.json: missing field gone; see the README$"),
        (
            lambda d: d.only(("n", "f", "l", "s")),
            r"unknown field\(s\) x; expected only n, f, l, s$",
        ),
        (lambda d: d["n"].integer(minimum=1), r"field n must be an integer >= 1, got true$"),
        (lambda d: d["f"].finite(), r"field f must be a finite number, got NaN$"),
        (
            lambda d: d["l"].elements("a pair", min_count=2, max_count=2),
            r"must be a pair, got \[1\]",
        ),
        (
            lambda d: d["s"].one_of(("gloo", "nccl")),
            r'field s must be one of gloo, nccl, got "mpi"',
        ),
    ],
)
def test_each_check_says_the_field_and_what_it_expected(read: Any, message: str) -> None:
    doc = _doc({"n": True, "f": float("nan"), "l": [1], "s": "mpi", "x": 0})
    with pytest.raises(PlanFormatError, match=message):
        read(doc)


def test_free_form_problems_and_numbers_that_need_not_be_finite() -> None:
    doc = _doc({"l": [1], "f": float("inf")})
    assert str(doc["l"].problem("too short")) == "doc.json: field l: too short"
    assert doc["f"].number() == float("inf")


def test_optional_fields_and_the_top_level() -> None:
    doc = _doc({"a": None, "b": 2})
    assert doc.get("a") is None and doc.get("c") is None
    b = doc.get("b")
    assert b is not None and b.integer() == 2 and b.path == "b"
    with pytest.raises(PlanFormatError, match=r"^doc\.json: the top level must be a JSON object"):
        _doc([1, 2]).obj()
