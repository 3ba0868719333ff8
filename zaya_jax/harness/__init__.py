"""Downstream evaluation: log-likelihood scoring on the compiled forward (`scoring.py`) and the
lm-eval-harness model `zaya` built on it and on `zaya_jax.generate` (`lm_eval_model.py`)."""
