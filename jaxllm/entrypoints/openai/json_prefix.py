"""The part of a JSON value's re-serialization that a prefix of its text already fixes.

Tool-call arguments are sent as `json.dumps(value, ensure_ascii=False)` of the
value the model wrote. While the text is still arriving, `dump_prefix` gives
the longest beginning of that string which no continuation of the text can
change, so that streamed argument fragments always add up to the whole
answer's arguments. Tokens are re-serialized as they complete: a number or
literal once a character after it arrives, a string character by character
(an escape once whole), separators as `", "` and `": "`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_NUMBER_CHARS = frozenset("-+0123456789.eE")
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n",
                   "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")


class Malformed(ValueError):
    """The text cannot begin a JSON value (or re-serializing it is not prefix-stable)."""


@dataclass
class Scanned:
    out: str  # the fixed beginning of json.dumps(value, ensure_ascii=False)
    end: int | None  # where the value ends in the text, None while it is unfinished


def _escaped(ch: str) -> str:
    if ch in '"\\' or ord(ch) < 0x20:
        return json.dumps(ch)[1:-1]
    return ch


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string(text: str, i: int) -> tuple[str, str, int | None]:
    """(its canonical text so far, its decoded value so far, end) of the string at i."""
    out, value, j = ['"'], [], i + 1
    while j < len(text):
        ch = text[j]
        if ch == '"':
            out.append('"')
            return "".join(out), "".join(value), j + 1
        if ord(ch) < 0x20:
            raise Malformed("a control character inside a string")
        if ch != "\\":
            decoded, j = ch, j + 1
        else:
            if j + 1 >= len(text):
                break
            esc = text[j + 1]
            if esc in _SIMPLE_ESCAPES:
                decoded, j = _SIMPLE_ESCAPES[esc], j + 2
            elif esc == "u":
                hex4 = text[j + 2:j + 6]
                if not all(c in _HEX for c in hex4):
                    raise Malformed("a bad \\u escape")
                if len(hex4) < 4:
                    break
                code, j2 = int(hex4, 16), j + 6
                if 0xD800 <= code < 0xDC00:  # a high surrogate: its pair may follow
                    tail = text[j2:j2 + 6]
                    if len(tail) < 6 and "\\u".startswith(tail[:2]) \
                            and all(c in _HEX for c in tail[2:]):
                        break  # the low half may still come
                    if tail[:2] == "\\u" and all(c in _HEX for c in tail[2:]) \
                            and 0xDC00 <= int(tail[2:], 16) < 0xE000:
                        code = 0x10000 + ((code - 0xD800) << 10) + int(tail[2:], 16) - 0xDC00
                        j2 += 6
                decoded, j = chr(code), j2
            else:
                raise Malformed(f"a bad escape \\{esc}")
        out.append(_escaped(decoded))
        value.append(decoded)
    return "".join(out), "".join(value), None


def _literal(text: str, i: int) -> Scanned:
    for word, value in (("true", "true"), ("false", "false"), ("null", "null")):
        if text.startswith(word, i):
            return Scanned(value, i + len(word))
        if word.startswith(text[i:]):
            return Scanned("", None)
    raise Malformed(f"unexpected {text[i]!r}")


def _number(text: str, i: int) -> Scanned:
    j = i
    while j < len(text) and text[j] in _NUMBER_CHARS:
        j += 1
    if j == len(text):
        return Scanned("", None)  # more digits may follow
    token = text[i:j]
    if not _NUMBER.fullmatch(token):
        raise Malformed(f"a bad number {token!r}")
    return Scanned(json.dumps(json.loads(token)), j)


def _container(text: str, i: int, depth: int) -> Scanned:
    is_object = text[i] == "{"
    close = "}" if is_object else "]"
    out, j, first, keys = [text[i]], i + 1, True, set()
    while True:
        j = _skip_ws(text, j)
        if j == len(text):
            return Scanned("".join(out), None)
        if text[j] == close:  # after a comma it is the next member's error instead
            out.append(close)
            return Scanned("".join(out), j + 1)
        if not first:
            if text[j] != ",":
                raise Malformed(f"expected ',' or {close!r}")
            out.append(", ")
            j = _skip_ws(text, j + 1)
            if j == len(text):
                return Scanned("".join(out), None)
        first = False
        if is_object:
            if text[j] != '"':
                raise Malformed("expected a key")
            key_out, key, end = _string(text, j)
            if end is None:
                out.append(key_out)
                return Scanned("".join(out), None)
            if key in keys:  # json.loads keeps the last value where the first key was
                raise Malformed(f"the key {key!r} repeats")
            keys.add(key)
            out.append(key_out)
            j = _skip_ws(text, end)
            if j == len(text):
                return Scanned("".join(out), None)
            if text[j] != ":":
                raise Malformed("expected ':'")
            out.append(": ")
            j += 1
        value = scan(text, j, depth + 1)
        out.append(value.out)
        if value.end is None:
            return Scanned("".join(out), None)
        j = value.end


def scan(text: str, i: int = 0, depth: int = 0) -> Scanned:
    """The value starting at `text[i]` (after whitespace); raises Malformed."""
    if depth > 200:
        raise Malformed("nested too deeply")
    i = _skip_ws(text, i)
    if i == len(text):
        return Scanned("", None)
    ch = text[i]
    if ch in "{[":
        return _container(text, i, depth)
    if ch == '"':
        out, _, end = _string(text, i)
        return Scanned(out, end)
    if ch in "-0123456789":
        return _number(text, i)
    return _literal(text, i)


def members(text: str, i: int) -> tuple[list[tuple[str, Scanned]], int | None]:
    """The members of the object at `text[i]` so far: (key, value) for every key that
    is whole (the last value may be unfinished), and the object's end, None while open.
    Raises Malformed."""
    if text[i] != "{":
        raise Malformed("expected an object")
    found: list[tuple[str, Scanned]] = []
    j = i + 1
    while True:
        j = _skip_ws(text, j)
        if j == len(text):
            return found, None
        if text[j] == "}":
            return found, j + 1
        if found:
            if text[j] != ",":
                raise Malformed("expected ',' or '}'")
            j = _skip_ws(text, j + 1)
            if j == len(text):
                return found, None
        if text[j] != '"':
            raise Malformed("expected a key")
        _, key, end = _string(text, j)
        if end is None:
            return found, None
        j = _skip_ws(text, end)
        if j == len(text):
            return found, None
        if text[j] != ":":
            raise Malformed("expected ':'")
        value = scan(text, j + 1, 1)
        found.append((key, value))
        if value.end is None:
            return found, None
        j = value.end


def dump_prefix(text: str) -> str:
    """The fixed beginning of `json.dumps(json.loads(text), ensure_ascii=False)` for any
    completion of `text`; empty for text that cannot begin a JSON value."""
    try:
        return scan(text).out
    except Malformed:
        return ""
