"""Mixture specs: `data.source` (one source or a comma-separated list) and `data.weights`.

Weights are shares of training rows (so of tokens): a source with weight 0.7 fills about 70% of
every batch. They are normalised, so "7,3" and "0.7,0.3" are the same mixture.
"""

from __future__ import annotations

import dataclasses

from zaya_jax.errors import ZayaError


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    spec: str  # builtin:NAME or a path
    weight: float  # normalised: the weights of a mixture sum to 1


def parse_mixture(source: str, weights: str = "") -> list[SourceSpec]:
    specs = [s.strip() for s in source.split(",")]
    if not source.strip() or not all(specs):
        raise ZayaError(f"data.source {source!r} has an empty entry; give one source or a "
                        "comma-separated list such as 'a.jsonl,b.parquet'")
    if len(set(specs)) != len(specs):
        raise ZayaError(f"data.source {source!r} names a source twice; list each once and set its data.weights")
    values = _weights(weights, len(specs))
    total = sum(values)
    return [SourceSpec(s, w / total) for s, w in zip(specs, values)]


def _weights(weights: str, count: int) -> list[float]:
    if not weights.strip():
        if count > 1:
            raise ZayaError(f"data.source lists {count} sources but data.weights is empty; "
                            f"set data.weights to {count} comma-separated weights, e.g. "
                            f"{','.join(['1'] * count)}")
        return [1.0]
    try:
        values = [float(w) for w in weights.split(",")]
    except ValueError:
        raise ZayaError(f"data.weights {weights!r} is not a comma-separated list of numbers") from None
    if len(values) != count:
        raise ZayaError(f"data.weights has {len(values)} value(s) but data.source lists {count} source(s); "
                        "give one weight per source")
    if not all(v > 0 for v in values):
        raise ZayaError(f"data.weights {weights!r} must all be positive; drop a source instead of weighting it 0")
    return values
