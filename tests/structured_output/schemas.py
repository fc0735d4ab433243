"""Random JSON schemas whose every instance is short, and a validator for that subset.

The schemas bound what a random-weight model can emit (integer ranges,
string lengths, item counts, closed objects), so that a constrained output
always ends within the test's token budget. `validate` checks an instance
against exactly the keywords `json_schemas` generates.
"""

from __future__ import annotations

import string
from typing import Any

from hypothesis import strategies as st

_NAMES = st.text(string.ascii_lowercase, min_size=1, max_size=4)


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    integer = st.tuples(st.integers(-50, 50), st.integers(0, 60)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]})
    text = st.tuples(st.integers(0, 2), st.integers(0, 3)).map(
        lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]})
    enum = st.lists(st.one_of(st.integers(-9, 99), st.text(string.ascii_letters, max_size=4)),
                    min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v})
    return st.one_of(integer, text, enum, st.just({"type": "boolean"}),
                     st.just({"type": "null"}))


def _array(items: st.SearchStrategy) -> st.SearchStrategy[dict[str, Any]]:
    return st.tuples(items, st.integers(0, 1), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})


def _object(values: st.SearchStrategy) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
        # Mostly all required, so that outputs are not just `{}`.
        optional = data.draw(st.lists(st.sampled_from(sorted(props)), unique=True, max_size=1))
        required = [p for p in props if p not in optional]
        return {"type": "object", "properties": props, "required": sorted(required),
                "additionalProperties": False}

    return st.builds(build, st.dictionaries(_NAMES, values, min_size=1, max_size=3), st.data())


def json_schemas() -> st.SearchStrategy[dict[str, Any]]:
    """Objects of at most two levels whose values are leaves or short arrays of leaves."""
    value = st.one_of(_leaf(), _array(_leaf()))
    return st.one_of(_object(st.one_of(value, _object(_leaf()))), _array(_leaf()))


def validate(schema: dict[str, Any], value: Any) -> None:
    """Raises AssertionError, with the path, where `value` breaks `schema`."""
    _check(schema, value, "$")


def _check(schema: dict[str, Any], value: Any, path: str) -> None:
    if "enum" in schema:
        assert any(value == e and type(value) is type(e) for e in schema["enum"]), path
        return
    kind = schema["type"]
    if kind == "integer":
        assert type(value) is int, path
        assert schema["minimum"] <= value <= schema["maximum"], path
    elif kind == "string":
        assert isinstance(value, str), path
        assert schema["minLength"] <= len(value) <= schema["maxLength"], path
    elif kind == "boolean":
        assert isinstance(value, bool), path
    elif kind == "null":
        assert value is None, path
    elif kind == "array":
        assert isinstance(value, list), path
        assert schema["minItems"] <= len(value) <= schema["maxItems"], path
        for i, item in enumerate(value):
            _check(schema["items"], item, f"{path}[{i}]")
    elif kind == "object":
        assert isinstance(value, dict), path
        assert set(value) <= set(schema["properties"]), path
        assert set(schema["required"]) <= set(value), path
        for key, item in value.items():
            _check(schema["properties"][key], item, f"{path}.{key}")
    else:
        raise AssertionError(f"{path}: the validator does not know type {kind!r}")
