"""zaya-jax: the ZAYA1 training stack in JAX/XLA.

Public surface: `zaya_jax.load(path)` returns a callable model from an Orbax checkpoint written
by this project or a Hugging Face ZAYA directory; `zaya_jax.generate(model, prompts, ...)`
continues token-id prompts with a cache; `ModelConfig` and `preset` describe models.
"""

from zaya_jax.config import ModelConfig, preset
from zaya_jax.errors import ZayaError

__version__ = "0.1.0"


def load(path: str, compute_dtype: str = "float32", **kernels):
    """Load a model: `model(input_ids, segment_ids=None, positions=None)` → fp32 logits.

    `kernels`: attention_kernel, moe_kernel, norm_kernel (default "auto"); see `zaya_jax.api.load`."""
    from zaya_jax.api import load as _load

    return _load(path, compute_dtype=compute_dtype, **kernels)


def generate(model, prompts, **options):
    """New token ids for each prompt (a list of token ids); see `zaya_jax.generation.generate`."""
    from zaya_jax.generation import generate as _generate

    return _generate(model, prompts, **options)


__all__ = ["ModelConfig", "ZayaError", "generate", "load", "preset", "__version__"]
