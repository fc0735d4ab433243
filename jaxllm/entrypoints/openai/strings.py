"""Every string of a request body must be valid Unicode before anything reads it.

JSON can carry a lone UTF-16 surrogate ("\\ud800"), which Python's json module
decodes into a `str` that no tokenizer, template engine or UTF-8 encoder takes.
The walk finds the first such string and names its field, e.g.
`messages[0].content`, for a 400.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from jaxllm.sampling_params import check_text


def check_strings(value: Any, path: str = "") -> None:
    """Raises a ParameterError naming the first string under `value` that is not valid
    Unicode (dict keys included)."""
    if isinstance(value, str):
        check_text(path or "body", value)
    elif isinstance(value, BaseModel):
        fields = {**value.__dict__, **(value.model_extra or {})}
        for name, v in fields.items():
            check_strings(v, f"{path}.{name}" if path else name)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_strings(k, path)
            named = isinstance(k, str) and k.isascii() and k.isprintable()
            check_strings(v, f"{path}.{k}" if named else path)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_strings(v, f"{path}[{i}]")
