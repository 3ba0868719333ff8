"""Nested string-keyed dicts ⇄ flat dicts with joined keys (`{"a": {"b": x}}` ⇄ `{"a/b": x}`).

Used for model state paths (separator "/") and experiment config keys (separator ".").
"""

from __future__ import annotations

from typing import Any, Mapping


def nest(flat: Mapping[str, Any], sep: str = "/") -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(sep)
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def flatten(tree: Mapping[str, Any], sep: str = "/", prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, sep, path + sep))
        else:
            out[path] = value
    return out
