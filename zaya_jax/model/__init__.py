"""The ZAYA1 model in Flax NNX: CCA attention, the ZAYA1 router with EDA, top-1 SwiGLU experts.

`Zaya` is the causal LM; `segments` prepares packed-sequence metadata; the other modules each
own one block of the math (docs/verification.md, "Where the model lives").
"""

from zaya_jax.model.params import BalancingBias, logical_axes
from zaya_jax.model.zaya import Zaya

__all__ = ["Zaya", "BalancingBias", "logical_axes"]
