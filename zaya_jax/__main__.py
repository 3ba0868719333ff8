"""`python -m zaya_jax` is the `zaya` command."""

import sys

from zaya_jax.cli import main

sys.exit(main())
