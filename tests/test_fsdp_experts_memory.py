"""Under fsdp the experts' weights are gathered a layer at a time inside their schedule
(`parallel/experts_schedule._gather_fsdp`): the compiled step keeps no copy of the stacked shards
in another layout (left to GSPMD, XLA made one of each expert weight before the layer scan and
held it through the step)."""

import re

import jax
import pytest

from paths import TINY
from zaya_jax.experiment import load_experiment
from zaya_jax.explore import xla_terms
from zaya_jax.train.program import build_program

_PARAMETER = re.compile(r"^\s*%(\S+) = (\S+) parameter\(\d+\).*op_name=\"state\.params\[\\'layers/moe/experts/(\w+)")


def _relaid_expert_weights(layout: dict[str, int]) -> list[str]:
    """The optimized step's instructions that copy or transpose a whole expert-weight argument."""
    mesh = [f"--config.mesh.{axis}={size}" for axis, size in layout.items()]
    program = build_program(load_experiment(TINY, ["--config.model.moe_kernel=xla", *mesh]), jax.devices()[:8])
    with xla_terms.dumping() as (options, _):
        program.compile_train_step_phases(options)
        folder = options["xla_dump_to"]
        _, hlo_path, _ = xla_terms.dump_files(folder)
        with open(hlo_path, encoding="utf-8") as f:
            hlo = f.read().splitlines()
    weights = {m.group(1): m.group(3) for m in map(_PARAMETER.match, hlo) if m}
    assert set(weights.values()) >= {"gate", "up", "down"}, "the experts' arguments were not found in the HLO"
    relaid = re.compile(r"= \S+ (?:copy|fusion)\(%(" + "|".join(map(re.escape, weights)) + r")\)")
    return [line.strip()[:120] for line in hlo if relaid.search(line)]


@pytest.mark.slow
def test_fsdp_gathers_the_experts_without_a_relaid_copy_of_their_stack():
    assert _relaid_expert_weights(dict(fsdp=4, sequence=2)) == []
