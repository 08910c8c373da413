"""Validating a JSON document a user may hand-edit (a cluster file, a plan), field by field.

A `JsonField` is one value of the document with the path that led to it
(``device.peak_flops.float32``, ``nodes.linear_1.inputs[0].tp``), the name of the document
(its file, or "plan") and the `AutoplanError` subclass to raise. Its methods check the value's
type and range and return it as a plain Python value, or step into an object or a list, so a
reader states each field's expectation once; every problem it finds raises one of two forms:

    <source>: field <path> must be <what was expected>, got <the value as JSON>
    <source>: field <path>: <what is wrong and what to change>

with "the top level" for the document itself, and "missing field <path>" or "unknown field(s)"
for its keys. Which fields a document has, and what its readers build, live with the readers
(`autoplan.cluster.fileio`, `autoplan.planfile.io`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from autoplan.errors import AutoplanError

__all__ = ["JsonField"]

_SHOWN_CHARS = 60


@dataclass(frozen=True)
class JsonField:
    """A JSON value, the path that led to it and where to report what is wrong with it."""

    value: Any
    source: str  # the document, in messages: a file path, "plan"
    error: type[AutoplanError]  # raised for every problem
    path: str = ""  # "" for the document itself
    # appended to "missing field" messages: where the document's fields are described
    hint: str = ""

    # ---------------------------------------------------------------- failing

    def fail(self, expected: str) -> AutoplanError:
        """The error saying this value must be `expected` ("a string", "> 0") instead."""
        return self.error(f"{self._name()} must be {expected}, got {_shown(self.value)}")

    def problem(self, text: str) -> AutoplanError:
        """The error saying `text` about this field."""
        return self.error(f"{self._name()}: {text}")

    # ---------------------------------------------------------------- objects and lists

    def obj(self) -> dict[str, Any]:
        """The value as a JSON object."""
        if not isinstance(self.value, dict):
            raise self.fail("a JSON object")
        return self.value

    def __getitem__(self, key: str) -> JsonField:
        """The required field `key` of this object."""
        obj = self.require((key,)).obj()
        return replace(self, value=obj[key], path=self._child_path(key))

    def get(self, key: str) -> JsonField | None:
        """The optional field `key` of this object; None when absent or null."""
        obj = self.obj()
        return None if obj.get(key) is None else self[key]

    def require(self, keys: tuple[str, ...]) -> JsonField:
        """This object, refused if it lacks one of `keys`."""
        missing = [key for key in keys if key not in self.obj()]
        if missing:
            hint = f"; {self.hint}" if self.hint else ""
            raise self.error(f"{self.source}: missing field {self._child_path(missing[0])}{hint}")
        return self

    def only(self, allowed: tuple[str, ...]) -> JsonField:
        """This object, refused if it has a key outside `allowed` (most likely a typo)."""
        unknown = sorted(set(self.obj()) - set(allowed))
        if unknown:
            names = ", ".join(self._child_path(k) for k in unknown)
            under = f" under {self.path}" if self.path else ""
            raise self.error(
                f"{self.source}: unknown field(s) {names}; expected only {', '.join(allowed)}"
                f"{under}"
            )
        return self

    def items(self) -> list[tuple[str, JsonField]]:
        """The object's fields in document order."""
        return [(key, self[key]) for key in self.obj()]

    def elements(
        self, expected: str = "a list", *, min_count: int = 0, max_count: int | None = None
    ) -> list[JsonField]:
        """The elements of a list of `min_count` to `max_count` elements (`expected` says so)."""
        value = self.value
        if not isinstance(value, list) or len(value) < min_count:
            raise self.fail(expected)
        if max_count is not None and len(value) > max_count:
            raise self.fail(expected)
        return [replace(self, value=v, path=f"{self.path}[{i}]") for i, v in enumerate(value)]

    # ---------------------------------------------------------------- scalars

    def text(self, *, non_empty: bool = False) -> str:
        """The value as a string (a non-empty one if `non_empty`)."""
        if not isinstance(self.value, str) or (non_empty and not self.value):
            raise self.fail("a non-empty string" if non_empty else "a string")
        return self.value

    def one_of(self, choices: tuple[str, ...]) -> str:
        """The value as one of the strings `choices`."""
        if not isinstance(self.value, str) or self.value not in choices:
            raise self.fail(f"one of {', '.join(choices)}")
        return self.value

    def integer(self, *, minimum: int = 0) -> int:
        """The value as an integer >= `minimum` (not a bool, nor a float such as 2.0)."""
        value = self.value
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < minimum:
            raise self.fail(f"an integer >= {minimum}")
        return int(value)

    def number(self) -> float:
        """The value as a number (an int or a float, infinite ones included)."""
        if not _is_number(self.value):
            raise self.fail("a number")
        return float(self.value)

    def finite(self) -> float:
        """The value as a finite number."""
        if not (_is_number(self.value) and math.isfinite(self.value)):
            raise self.fail("a finite number")
        return float(self.value)

    def positive(self) -> float:
        """The value as a finite number > 0."""
        number = self.finite()
        if number <= 0:
            raise self.fail("> 0")
        return number

    def seconds(self) -> float:
        """The value as a finite duration >= 0 s."""
        number = self.finite()
        if number < 0:
            raise self.fail(">= 0 s")
        return number

    def fraction(self) -> float:
        """The value as a fraction in (0, 1] (of a peak rate)."""
        number = self.finite()
        if not 0 < number <= 1:
            raise self.fail("a fraction of peak in (0, 1]")
        return number

    def _name(self) -> str:
        return f"{self.source}: " + (f"field {self.path}" if self.path else "the top level")

    def _child_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """The value as the file would write it, cut short."""
    try:
        text = json.dumps(value, default=repr)
    except (TypeError, ValueError):  # keys JSON cannot have, a list that holds itself
        text = repr(value)
    return text[:_SHOWN_CHARS]
