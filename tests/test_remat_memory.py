"""Remat saves memory in XLA's compiled step, by the amounts the explorer's activation model predicts.

An activation-dominated step (4 layers, hidden 512, 4K tokens, Pallas attention so there are no
[S, S] logits), compiled on one CPU device from abstract shapes under each policy: XLA's
temporaries (activations, gradients, the loss and the optimizer's scratch) must fall from `none`
to `dots` to `full`, and each policy's temporaries relative to `none` must be the explorer's
prediction of the same ratio, within 20%.
"""

import jax
import pytest

from zaya_jax.experiment import load_experiment
from zaya_jax.explore import memory
from zaya_jax.explore.against_xla import memory_report
from zaya_jax.explore.workload import Workload
from zaya_jax.hardware import PROFILES
from zaya_jax.train.program import build_program

ACTIVATION_DOMINATED = ["--config.model.num_hidden_layers=4", "--config.model.hidden_size=512",
                        "--config.train.seq_len=512", "--config.model.max_position_embeddings=512",
                        "--config.train.global_batch_size=8", "--config.model.attention_kernel=pallas",
                        # One block per scan iteration (tiny_cpu compiles 4): XLA's CPU scheduler
                        # undoes remat in straight-line code, unrolled or several blocks per iteration.
                        "--config.train.scan_unroll=1"]
ONE_DEVICE = dict(data=1, fsdp=1, expert=1, tsp=1, tensor=1, sequence=1)


# The explorer models the GPU kernels' memory: the experts compile on the `xla` grouped matmul
# (ragged_dot, which XLA also emits on GPUs). The CPU-only `tiled` backend multiplies per tile, and
# those products are dot outputs the `dots` policy keeps ([tiles, rows, width] per layer: twice the
# prediction's stored activations under `dots`; no GPU step has them).
KERNEL = "xla"


def _experiment(policy, extra=()):
    return load_experiment("experiments/tiny_cpu.py", ACTIVATION_DOMINATED + [f"--config.model.moe_kernel={KERNEL}"]
                           + list(extra) + [f"--config.train.remat={policy}"])


def _xla_temporaries(policy, extra=()) -> int:
    program = build_program(_experiment(policy, extra), devices=jax.devices()[:1])
    compiled, _ = program.compile_train_step()
    return compiled.memory_analysis().temp_size_in_bytes


def _predicted_temporaries(policy, extra=()) -> float:
    """What the explorer says XLA's temporaries hold: all but the step's inputs, plus the gradients."""
    m = memory.predict(Workload.from_experiment(_experiment(policy, extra=extra), PROFILES["cpu"], 1, 1), ONE_DEVICE)
    return m.activation_bytes - m.parts["inputs"] + m.grad_bytes


class _Compiled(dict):
    """Each policy's temporaries, compiled when a test first asks (a test of one policy compiles two)."""

    def __missing__(self, policy):
        self[policy] = _xla_temporaries(policy)
        return self[policy]


@pytest.fixture(scope="module")
def temporaries():
    return _Compiled()


def test_remat_policies_cut_xla_temporaries_in_order(temporaries):
    t = temporaries
    assert t["none"] > t["moe"] > t["dots"] > t["full"]
    assert t["full"] < 0.55 * t["none"]  # measured 0.49 (jax 0.10.2, CPU)


@pytest.mark.parametrize("policy", ["dots", "moe", "full"])
def test_saving_matches_the_explorer_activation_model(temporaries, policy):
    measured = temporaries[policy] / temporaries["none"]
    predicted = _predicted_temporaries(policy) / _predicted_temporaries("none")
    assert abs(measured / predicted - 1) < 0.2, (policy, measured, predicted)


def test_a_hybrid_units_backward_holds_the_whole_unit_recomputed():
    """The checkpoint wraps the layer scan's body, the pattern's unit: XLA:CPU recomputes both layers
    of an `LC` unit before the unit's backward (`memory.working_set_per_token`). XLA's working set
    under `dots` (`--terms`' `block_working_set`, the experts' backward weights included) against
    the prediction's: measured 258 MiB, predicted 252; priced as a one-layer unit is, 133."""
    exp = _experiment("dots", ["--config.model.layer_pattern=LC"])
    measured = memory_report(build_program(exp, devices=jax.devices()[:1]), terms=True)["terms"]["block_working_set"]
    run = Workload.from_experiment(exp, PROFILES["cpu"], 1, 1)
    predicted = memory.by_term(memory.predict(run, ONE_DEVICE))["block_working_set"]
    assert abs(measured / predicted - 1) < 0.15, (measured / 2**20, predicted / 2**20)
