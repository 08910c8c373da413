"""The house rules a linter does not check (tools/check_house.py): no import cycle, at most one
module over 500 lines, no two modules or classes of one name."""

from __future__ import annotations

from tools.check_house import problems


def test_the_package_keeps_its_house_rules() -> None:
    assert problems() == []
