"""`python -m zaya_jax` is the `zaya` command."""

from zaya_jax.cli import entry

entry()
