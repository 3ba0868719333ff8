"""The GPU lowering gate: every Pallas kernel and the bf16 train step of every layout family lower
for CUDA and ROCm on this CPU machine (Pallas → Triton), with exactly the Triton calls they should.

The CPU interpreter accepts programs Triton rejects (a `slice` of a 2-D mask, for one), so these
tests lower with the GPU's kernel target: Pallas compiled, that platform's tuning row.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from zaya_jax import jax_compat
from zaya_jax.errors import ZayaError
from zaya_jax.kernels import gpu_lowering, resources, tuning
from zaya_jax.kernels.registry import resolve, target, targeting
from zaya_jax.parallel import tsp_experts, zigzag
from zaya_jax.train.program import program_for_target

PLATFORMS = ("cuda", "rocm")


def _skip_unless_lowerable(platform):
    ok, why = gpu_lowering.can_lower(platform)
    if not ok:
        pytest.skip(why)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("platform", PLATFORMS)
def test_every_kernel_lowers_forward_and_backward_at_zaya1_shapes(platform, dtype):
    _skip_unless_lowerable(platform)
    for case in gpu_lowering.kernel_cases(dtype):
        assert dict(gpu_lowering.lower_kernel_case(case, platform)) == case.expected


@pytest.mark.parametrize("platform", PLATFORMS)
def test_kernels_are_lowered_with_the_platform_tuning_row(platform):
    _skip_unless_lowerable(platform)
    row = tuning.TABLE[f"{platform}/16"]
    family = {"zaya_forward_kernel": "attention", "zaya_dq_kernel": "attention", "zaya_dkv_kernel": "attention",
              "zaya_grouped_matmul": "grouped_matmul", "zaya_grouped_matmul_transposed": "grouped_matmul",
              **dict.fromkeys(("zaya_linear_attention_fwd", "zaya_linear_attention_dq", "zaya_linear_attention_dkv"),
                              "linear_attention")}
    for case in gpu_lowering.kernel_cases(jnp.bfloat16):
        for name, stages, warps in gpu_lowering.launch_params(gpu_lowering.lower(case.fn, case.args, platform)):
            blocks = row[family.get(name, "rms_norm")]
            assert (stages, warps) == (getattr(blocks, "num_stages", stages), blocks.num_warps), (case.name, name)


def _sliced_mask_kernel(x_ref, o_ref):
    """A row cut from a 2-D mask is a `slice`, which Triton lacks (an easy slip in a masked RMSNorm)."""
    mask = jnp.arange(8)[:, None] < jnp.arange(16)[None, :]
    o_ref[...] = jnp.where(mask[1], x_ref[...], 0.0)


def test_gate_names_a_kernel_that_triton_cannot_lower():
    _skip_unless_lowerable("cuda")

    def broken(x):
        return pl.pallas_call(_sliced_mask_kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                              compiler_params=plgpu.CompilerParams())(x)

    case = gpu_lowering.KernelCase("sliced mask", broken, (jax.ShapeDtypeStruct((16,), jnp.float32),), {})
    with pytest.raises(ZayaError, match=r"^sliced mask does not lower for cuda: NotImplementedError: .*slice"):
        gpu_lowering.lower_kernel_case(case, "cuda")
    # ...while the interpreter runs it without complaint: the blind spot this gate closes.
    out = pl.pallas_call(_sliced_mask_kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                         interpret=True)(jnp.ones(16))
    assert float(out.sum()) == 14.0  # row 1 of the mask: columns 2..15


def _loop_kernel(steps_of):
    """Sums x over `steps_of(pid)` iterations: the grouped matmul's loop over its K blocks."""
    def kernel(x_ref, o_ref):
        steps = steps_of(pl.program_id(0))
        o_ref[...] = jax.lax.fori_loop(0, steps, lambda i, acc: acc + x_ref[...], jnp.zeros_like(x_ref))
    return kernel


def _call(kernel):
    return lambda x: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), grid=(2,),
                                    compiler_params=plgpu.CompilerParams())(x)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_gate_names_a_kernel_whose_triton_module_triton_would_reject(platform):
    """A select of two literals lowers to the predicate's type (i1), and an scf.for with an i1 bound
    next to i32 ones is a module the GPU's Triton rejects while this lowering builds it without a
    word: the grouped matmul's bug that the first H200 run found."""
    _skip_unless_lowerable(platform)
    x = (jax.ShapeDtypeStruct((16,), jnp.float32),)
    rejected = _call(_loop_kernel(lambda pid: jnp.where(pid >= 0, 4, 0)))
    with pytest.raises(ZayaError, match=r"^Triton would reject Pallas kernel .*'scf\.for' op failed to verify "
                                        r"that all of \{lowerBound, upperBound, step\} have same type "
                                        r"\(test_gpu_lowering\.py:\d+\)"):
        gpu_lowering.lower(rejected, x, platform)
    fixed = _call(_loop_kernel(lambda pid: (pid >= 0).astype(jnp.int32) * 4))  # the kernel's form now
    assert sum(gpu_lowering.triton_calls(gpu_lowering.lower(fixed, x, platform)).values()) == 1
    # the verifier is on inside the gate only: JAX's own builder is back after it
    assert jax_compat.reaches()["triton_module_builder"].__module__ == "jax._src.pallas.triton.lowering"


def test_targeting_sets_auto_backends_and_interpret_mode_then_restores_them():
    here = target()
    with targeting("rocm"):
        assert target() == "rocm"
        assert {k: resolve(k, "auto") for k in ("attention", "grouped_matmul", "rms_norm")} == \
            {"attention": "pallas", "grouped_matmul": "pallas", "rms_norm": "pallas"}
        assert tuning.blocks_for("attention", jnp.float32) is tuning.TABLE["rocm/32"]["attention"]
        with pytest.raises(ZayaError, match=r"cudnn attention backend needs an NVIDIA GPU \(the target is rocm\)"):
            resolve("attention", "cudnn")
    assert target() == here
    with pytest.raises(ZayaError, match="kernel target must be one of"):
        with targeting("metal"):
            pass


# ---------------------------------------------------------------------------------------------
# The bf16 train step of every layout family


def expected_calls(program, mesh: dict) -> dict:
    """The Triton calls of one train step, from the model, layout and remat ('none' or 'full').

    Per traced block (one when the layers are scanned, each layer when unrolled): the attention kernels run once per KV-group bucket (TSP gathers one group at a time)
    and per sequence chunk (one static causal-offset branch per device); three norms; two grouped
    matmuls forward (the fused gate/up, down) and two input-gradient ones backward, plus two
    weight-gradient ones. The TSP ring's steps are one loop (its body: one copy of a step's matmuls
    whatever the ring's length) except at two ranks, where the two steps are unrolled and call
    every grouped matmul twice; its backward recomputes the gate/up one. Full
    remat runs every block's forward kernels a second time in the backward. A re-routing balancer
    runs every block's forward kernels once more after the update (the final norm aside); unrolled,
    XLA drops the last block's experts there, as only its router's probabilities are read.
    """
    model, step = program.exp.model, program.step_cfg
    layers = 1 if step.scan_layers else model.num_hidden_layers
    tsp = mesh.get("tsp", 1)
    # One causal-offset branch per sequence device, one kernel per chunk it holds (two under zigzag).
    chunks = tsp * mesh.get("sequence", 1) * zigzag.chunks_per_device(program.zigzagged)
    again = 2 if step.remat == "full" else 1
    reroutes = 1 if program.balancer.reroutes else 0
    forwards = again + reroutes
    dead_experts = reroutes if not step.scan_layers else 0
    attention = layers * (model.num_key_value_heads if tsp > 1 else 1) * chunks
    forward_gmm, backward_gmm = (2, 3) if tsp > 1 else (2, 2)
    ring_copies = 2 if tsp == tsp_experts.UNROLLED else 1
    return {
        "zaya_forward_kernel": attention * forwards, "zaya_dq_kernel": attention, "zaya_dkv_kernel": attention,
        "zaya_grouped_matmul": ring_copies * (layers * (forward_gmm * forwards + backward_gmm) - forward_gmm * dead_experts),
        "zaya_grouped_matmul_transposed": layers * ring_copies * 2,
        "zaya_rms_norm_fwd": 3 * layers * forwards + 1, "zaya_rms_norm_bwd": 3 * layers + 1,
    }


LAYOUTS = {  # experiment file → the mesh it sets (the rest over mesh.data)
    "one_device": ("experiments/layouts/base.py", {}),
    "fsdp8": ("experiments/layouts/fsdp8.py", {"fsdp": 8}),
    "expert4_data2": ("experiments/layouts/expert4_data2.py", {"expert": 4, "data": 2}),
    "tsp8": ("experiments/layouts/tsp8.py", {"tsp": 8}),
    "tsp4_data2": ("experiments/layouts/tsp4_data2.py", {"tsp": 4, "data": 2}),
    "sequence4_data2": ("experiments/layouts/sequence4_data2.py", {"sequence": 4, "data": 2}),
    "tensor2_sequence4": ("experiments/layouts/tensor2_sequence4.py", {"tensor": 2, "sequence": 4}),
    "tsp2_expert2_data2": ("experiments/layouts/base.py", {"tsp": 2, "expert": 2, "data": 2}),
    "tensor2_fsdp2_data2": ("experiments/layouts/base.py", {"tensor": 2, "fsdp": 2, "data": 2}),
}


def lower_step(config: str, overrides: list[str], platform: str, devices=None):
    """(program, Triton calls by kernel) of the experiment's train step lowered for `platform`."""
    program = program_for_target(config, overrides, platform, devices)
    return program, gpu_lowering.triton_calls(program.lower_train_step().as_text())


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_train_step_of_each_layout_lowers_with_exact_triton_calls(layout, platform):
    _skip_unless_lowerable(platform)
    config, mesh = LAYOUTS[layout]
    overrides = ["--config.model.num_hidden_layers=1", "--config.model.compute_dtype=bfloat16",
                 "--config.train.remat=none", *(f"--config.mesh.{axis}={size}" for axis, size in mesh.items())]
    devices = jax.devices()[:1] if layout == "one_device" else None
    program, calls = lower_step(config, overrides, platform, devices)
    assert {a: s for a, s in program.mesh.shape.items() if s > 1} == mesh
    assert program.step_cfg.remat == "none"
    assert dict(calls) == expected_calls(program, mesh)


@pytest.mark.parametrize("balancer", ["spread", "solve"])
def test_only_the_re_routing_balancer_runs_a_second_forward(balancer):
    _skip_unless_lowerable("cuda")
    overrides = ["--config.model.num_hidden_layers=1", "--config.model.compute_dtype=bfloat16",
                 "--config.train.remat=none", f"--config.optim.balancer={balancer}"]
    program, calls = lower_step("experiments/layouts/base.py", overrides, "cuda", jax.devices()[:1])
    assert calls["zaya_forward_kernel"] == (2 if balancer == "solve" else 1)
    assert dict(calls) == expected_calls(program, {})


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("mesh", [{"data": 8}, {"data": 2, "tsp": 2, "expert": 2}, {"data": 2, "fsdp": 2, "tensor": 2}],
                         ids=str)
def test_the_data_replicas_micro_batch_loop_lowers_with_exact_triton_calls(mesh, platform):
    # Two micro-batches: the loop runs in parallel/grad_reduction.py's shard_map manual over data, the
    # kernels and the layer schedules nested inside it (traced once, whatever the micro-batches).
    _skip_unless_lowerable(platform)
    overrides = ["--config.model.num_hidden_layers=1", "--config.model.compute_dtype=bfloat16",
                 "--config.train.remat=none", "--config.train.grad_accum_steps=2", "--config.train.global_batch_size=16",
                 *(f"--config.mesh.{axis}={size}" for axis, size in mesh.items())]
    program, calls = lower_step("experiments/layouts/base.py", overrides, platform)
    assert program.step_cfg.reduction is not None
    assert dict(calls) == expected_calls(program, mesh)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_default_gpu_configuration_lowers_end_to_end(platform):
    """ZAYA1-base phase 1 as shipped (bf16, FSDP over a node, full remat, `auto` kernels), two layers deep."""
    _skip_unless_lowerable(platform)
    overrides = ["--config.model.num_hidden_layers=2", "--config.train.global_batch_size=32"]
    program, calls = lower_step("experiments/zaya1_base_phase1.py", overrides, platform)
    model = program.exp.model
    assert (model.compute_dtype, model.hidden_size, model.num_attention_heads, model.num_key_value_heads) == \
        ("bfloat16", 2048, 8, 2)
    assert program.step_cfg.remat == "full"
    assert dict(calls) == expected_calls(program, {"fsdp": 8})
    unrolled, unrolled_calls = lower_step("experiments/zaya1_base_phase1.py",
                                          overrides + ["--config.train.scan_layers=false"], platform)
    assert dict(unrolled_calls) == expected_calls(unrolled, {"fsdp": 8})


def test_a_program_targeted_at_a_gpu_lowers_but_will_not_compile_on_cpu():
    program = program_for_target("experiments/layouts/base.py", ["--config.model.num_hidden_layers=1"], "cuda",
                                 jax.devices()[:1])
    assert not program.runs_here()
    with pytest.raises(ZayaError, match="kernels target cuda but its devices are cpu: it can be lowered"):
        program.compile_train_step()


# ---------------------------------------------------------------------------------------------
# Shared memory of every tuning row


def test_every_gpu_tuning_row_fits_the_shared_memory_of_every_device_of_its_target():
    assert resources.problems() == []
    rows = {r["row"] for r in resources.report()}
    assert rows == {"cuda/16", "cuda/32", "rocm/16", "rocm/32"}


def test_shared_memory_model_reproduces_maxtexts_mi300x_failure_and_names_the_row():
    """MaxText's flash attention (128 x 128 blocks, d 128, bf16, one stage) asked MI300X for 98304 bytes."""
    maxtext = tuning.AttentionBlocks(block_q=128, block_k=128, block_q_bwd=128, block_k_bwd=128, num_stages=1)
    assert resources.attention(maxtext, itemsize=2)[0] == resources.Usage("forward", 98304)
    table = {"rocm/16": dict(tuning.TABLE["rocm/16"], attention=maxtext)}
    with pytest.raises(ZayaError, match=r"^tuning row rocm/16: the attention kernel's forward program needs "
                                        r"98304 bytes of shared memory, mi300x has 65536 \(and \d+ more\)$"):
        resources.check_table(table)


# ---------------------------------------------------------------------------------------------
# tools/lower_for_gpu.py


def _lower_for_gpu(*args):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, os.path.join(root, "tools", "lower_for_gpu.py"), *args], cwd=root,
                          capture_output=True, text=True, timeout=300)


def test_lower_for_gpu_reports_each_kernels_triton_calls_and_writes_json(tmp_path):
    _skip_unless_lowerable("rocm")
    out = tmp_path / "lowering.json"
    result = _lower_for_gpu("--config=experiments/layouts/tsp4_data2.py", "--platform=rocm", "--devices=8",
                            "--config.model.num_hidden_layers=1", "--config.model.compute_dtype=bfloat16",
                            f"--out={out}")
    assert result.returncode == 0, result.stderr[-2000:]
    import json

    [step] = json.loads(out.read_text())["steps"]
    assert (step["platform"], step["mesh"], step["compute_dtype"]) == ("rocm", {"data": 2, "tsp": 4}, "bfloat16")
    # Two KV groups x four chunk branches x the two zigzag chunks each branch attends for, in the
    # step's forward and the solve balancer's re-route.
    assert step["triton_calls"]["zaya_forward_kernel"] == 2 * 4 * 2 * 2
    assert f"{sum(step['triton_calls'].values())} Triton calls" in result.stdout


@pytest.mark.parametrize("args, words", [
    (["--platform=metal", "--kernels"], "--platform takes cuda, rocm (comma-separated), got 'metal'"),
    ([], "give --config=EXPERIMENT (a train step to lower), --kernels, or both"),
    (["--kernels", "--config.train.steps=3"], "--config.train.steps=3 needs --config"),
    (["--config=experiments/nope.py"], "experiment config experiments/nope.py does not exist"),
    (["--config=experiments/layouts/tsp8.py", "--devices=4", "--platform=cuda"], "cannot fill 4 devices"),
])
def test_lower_for_gpu_bad_input_is_one_line_and_exit_2(args, words):
    result = _lower_for_gpu(*args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("lower_for_gpu: error: ") and result.stderr.strip().count("\n") == 0
    assert words in result.stderr
