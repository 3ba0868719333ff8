"""Checkpoints: safetensors streaming I/O, the HF ⇄ zaya-jax tensor mapping, Orbax storage, conversion."""
