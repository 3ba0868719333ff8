"""The mesh explorer's formulas on hand-worked cases: placement, collective times, state bytes,
activations, FLOPs and MFU, ranking and its refusals (no compiling here; see test_mesh_validate)."""

import dataclasses
import json
import math
import re

import pytest

from zaya_jax import hardware
from zaya_jax.config import preset
from zaya_jax.errors import ZayaError
from zaya_jax.explore import inventory, memory, report, step_time
from zaya_jax.explore.collectives import Network, load_curves
from zaya_jax.explore.explorer import explore, fits_nowhere_message
from zaya_jax.explore.placement import Span, layouts, spans
from zaya_jax.explore.workload import Workload, share
from zaya_jax.kernels import tiled_grouped_matmul
from zaya_jax.parallel.axes import MESH_AXES
from meshes import mesh_sizes
from zaya_jax.train import flops

TINY = preset("tiny", compute_dtype="float32")
MI300X, H100 = hardware.profile("mi300x"), hardware.profile("h100")


def run(cfg=TINY, hw=MI300X, nodes=1, seq=64, batch=16, accum=1, remat="none"):
    return Workload(cfg, seq, batch, accum, remat, hw, nodes, 8, vocab_chunk=64)


def test_layouts_are_every_ordered_factorization():
    assert len(layouts(8)) == math.comb(3 + 5, 5)  # 2^3 over six axes
    assert all(math.prod(s.values()) == 12 for s in layouts(12))
    assert len({tuple(s.values()) for s in layouts(12)}) == len(layouts(12))


def test_spans_place_chatty_axes_inside_a_node():
    assert spans(mesh_sizes(data=128, fsdp=8), 8) == {**{a: Span(1, 1) for a in MESH_AXES}, "fsdp": Span(8, 1),
                                               "data": Span(1, 128)}
    s = spans(mesh_sizes(data=64, tsp=16), 8)
    assert s["tsp"] == Span(8, 2) and s["data"] == Span(1, 64)
    s = spans(mesh_sizes(data=64, sequence=2, fsdp=8), 8)  # fsdp is placed inside sequence
    assert s["fsdp"] == Span(8, 1) and s["sequence"] == Span(1, 2) and s["data"] == Span(1, 64)
    s = spans(mesh_sizes(tensor=2, expert=4), 8)
    assert s["tensor"] == Span(2, 1) and s["expert"] == Span(4, 1)


def test_collective_times_by_hand():
    net, gb = Network(MI300X), 1e9
    # 8 GPUs of one node on a full xGMI mesh: 7 links x 48 GB/s x 0.9.
    assert net.time("all_gather", gb, Span(8, 1)) == pytest.approx(13e-6 + gb * 7 / 8 / (7 * 48e9 * 0.9))
    assert net.time("all_reduce", gb, Span(8, 1)) == pytest.approx(2 * net.time("reduce_scatter", gb, Span(8, 1)))
    # Two GPUs of a node share one link.
    assert net.time("all_gather", gb, Span(2, 1)) == pytest.approx(13e-6 + gb / 2 / (48e9 * 0.9))
    # One GPU per node: the NIC; hierarchical: the node's phase, then 1/8 of the bytes over the NIC.
    nic = 50e9 * 0.94
    assert net.time("all_gather", gb, Span(1, 2)) == pytest.approx(10e-6 + gb / 2 / nic)
    assert net.time("all_gather", gb, Span(8, 4)) == pytest.approx(
        net.time("all_gather", gb, Span(8, 1)) + 30e-6 + gb / 8 * 3 / 4 / nic)
    # NVSwitch: any subgroup gets the full port.
    h = Network(H100)
    assert h.time("all_gather", gb, Span(2, 1)) == pytest.approx(8e-6 + gb / 2 / (450e9 * 0.82))
    assert net.time("permute", gb, Span(8, 1)) == pytest.approx(13e-6 + gb / (48e9 * 0.9))
    assert net.time("all_gather", gb, Span(1, 1)) == 0.0


def test_measured_curves_replace_the_model(tmp_path):
    path = tmp_path / "busbw.json"
    path.write_text(json.dumps([
        {"tier": "intra", "op": "all_gather", "group": 8, "bytes": 1e6, "busbw_gb_per_s": 100},
        {"tier": "intra", "op": "all_gather", "group": 8, "bytes": 1e8, "busbw_gb_per_s": 300}]))
    net = Network(MI300X, load_curves(str(path)))
    assert net.busbw("intra", "all_gather", 8, 1e7) == pytest.approx(200e9)  # log-interpolated
    assert net.busbw("intra", "all_gather", 4, 1e9) == pytest.approx(300e9)  # nearest group, clamped
    assert net.busbw("intra", "all_reduce", 8, 1e7) == pytest.approx(7 * 48e9 * 0.9)  # not measured: modelled


@pytest.mark.parametrize("records, words", [
    ("[]", "non-empty"), ("{", "not valid JSON"),
    ('[{"tier": "intra", "op": "all_gather", "group": 8, "bytes": 1}]', "has no 'busbw_gb_per_s'"),
    ('[{"tier": "rack", "op": "all_gather", "group": 8, "bytes": 1, "busbw_gb_per_s": 1}]', "tier 'rack'"),
    ('[{"tier": "intra", "op": "gather", "group": 8, "bytes": 1, "busbw_gb_per_s": 1}]', "op 'gather'"),
    ('[{"tier": "intra", "op": "all_gather", "group": 8, "bytes": -1, "busbw_gb_per_s": 1}]', "positive"),
])
def test_bad_curve_files_say_what_is_wrong(tmp_path, records, words):
    path = tmp_path / "bad.json"
    path.write_text(records)
    with pytest.raises(ZayaError, match=words):
        load_curves(str(path))
    with pytest.raises(ZayaError, match="does not exist"):
        load_curves(str(tmp_path / "missing.json"))


def test_state_bytes_by_hand():
    from zaya_jax.model.state import expected_shapes

    deep = TINY.replace(num_hidden_layers=5)  # one stacked block's weights stand for all five
    biases = 5 * (deep.num_experts + 1)  # balancing biases: state, not parameters
    inert = deep.router_hidden_size  # layer 0's EDA scale: in the stacked state, not the per-layer model
    assert sum(g.count * g.elements for g in inventory.param_groups(deep)) == sum(
        math.prod(s) for s in expected_shapes(deep).values()) - biases + inert
    cfg = TINY  # H 64, 4 heads / 2 KV of 16, 4 experts x 32, router 16, vocab 256, 2 layers
    groups = inventory.param_groups(cfg)
    total = sum(g.count * g.elements for g in groups)
    one = inventory.state_bytes(cfg, mesh_sizes())
    biases = cfg.num_hidden_layers * (cfg.num_experts + 1) * 4
    muon = sum(g.count * g.elements for g in groups if g.optimizer == "muon")
    assert one.params == 4 * total + biases and one.grads == 4 * total
    assert one.optimizer == 4 * muon + 8 * (total - muon) + 2 * biases
    # fsdp 2 halves every parameter with a hidden (`embed`) dimension; tsp 2 halves the experts on their width.
    experts = next(g for g in groups if g.path.endswith("experts/gate"))
    assert inventory.local_bytes(experts, mesh_sizes(fsdp=2)) == 4 * 4 * 64 * 32 / 2
    assert inventory.local_bytes(experts, mesh_sizes(tsp=2)) == 4 * 4 * 64 * 32 / 2
    assert inventory.local_bytes(experts, mesh_sizes(expert=4, fsdp=2), gathered=("fsdp",)) == 1 * 64 * 32 * 4  # one expert
    router = next(g for g in groups if g.path.endswith("router/fc1"))
    assert inventory.shard_count(router, mesh_sizes(fsdp=2, tsp=2)) == 1  # no hidden dimension: replicated


def test_remat_full_keeps_only_block_inputs():
    r = run(remat="full", batch=16, seq=64)
    m = memory.predict(r, mesh_sizes(data=8))
    tokens = 16 * 64 / 8
    assert m.parts["stored_activations"] == tokens * TINY.num_hidden_layers * (64 + 16) * 4
    none = memory.predict(run(remat="none"), mesh_sizes(data=8))
    assert none.parts["stored_activations"] > 5 * m.parts["stored_activations"]
    # One micro-batch: ZeRO-1's shards of the gradients; several: the whole running sum and this one's.
    state = inventory.state_bytes(TINY, mesh_sizes(data=8), zero1=True)
    assert m.grad_bytes == state.scattered_grads < state.grads / 4
    assert memory.predict(run(remat="full", accum=2), mesh_sizes(data=8)).grad_bytes == 2 * state.grads


def test_cpu_ragged_dot_operands_are_priced_for_the_xla_grouped_matmul_on_a_cpu_device_only():
    """Per (local expert, row), fp32 values: the larger of the down product's backward (its masked
    cotangent twice, the kept masked inputs H + W, the byte mask H/4) and the gate/up's — with
    one layer a scan step its masked cotangent twice 2·2W and its own input H; with several
    layers in the body also the down's masked input W, a second copy of its own H and the mask,
    or at narrow widths another layer's inputs, 4H + 2W; an unrolled iteration's every layer's
    kept inputs beside the down's cotangent — as read off XLA's buffers
    (tests/test_xla_terms.py, benchmarks/explorer_drawn_shapes*.json)."""
    sizes = mesh_sizes(expert=2, data=4)
    local_experts, rows = 4 / 2, 16 * 64 / 8 * 2  # the expert axis gathers 2 devices' tokens
    wide = run(TINY.replace(moe_kernel="xla", moe_intermediate_size=64), hw=hardware.profile("cpu"))
    one_layer_gate_up = 4 * 64 + 64  # W = 64: larger than the down's 3·64 + 64 + 16
    assert memory.cpu_kernel_bytes(wide, sizes, share(wide, sizes)) == local_experts * rows * one_layer_gate_up * 4
    cpu = run(TINY.replace(moe_kernel="xla"), hw=hardware.profile("cpu"))
    down_backward = 3 * 64 + 32 + 64 / 4  # W = 32: one layer's gate/up backward, 4·32 + 64, is smaller
    assert memory.cpu_kernel_bytes(cpu, sizes, share(cpu, sizes)) == local_experts * rows * down_backward * 4
    hybrid = run(TINY.replace(moe_kernel="xla", layer_pattern="LC", moe_intermediate_size=64), hw=hardware.profile("cpu"))
    gate_up_backward = 5 * 64 + 2 * 64 + 64 / 4  # two layers a step, W = 64: larger than the down's and 4H + 2W
    assert memory.cpu_kernel_bytes(hybrid, sizes, share(hybrid, sizes)) == local_experts * rows * gate_up_backward * 4
    narrow = run(TINY.replace(moe_kernel="xla", layer_pattern="LC"), hw=hardware.profile("cpu"))
    two_layers = 4 * 64 + 2 * 32  # W = 32: another layer's masked inputs, larger than 5W + 2H + H/4 = 304
    assert memory.cpu_kernel_bytes(narrow, sizes, share(narrow, sizes)) == local_experts * rows * two_layers * 4
    # An unrolled iteration makes every layer's masked inputs (H + W + H/4) before its first backward,
    # with or without remat: two layers 2·112 + 2H = 352, above the several-layer gate/up's 4H + 2W.
    for policy, unroll in (("none", 2), ("dots", 4)):
        unrolled = dataclasses.replace(cpu, scan_unroll=unroll, remat=policy)
        assert memory.cpu_kernel_bytes(unrolled, sizes, share(cpu, sizes)) == \
            local_experts * rows * (unroll * (64 + 32 + 64 / 4) + 2 * 64) * 4
    tsp = mesh_sizes(tsp=8)  # a ring step's slice of the width, W = 4: the down's backward is larger
    down_backward = 3 * 64 + 4 + 64 / 4
    assert memory.cpu_kernel_bytes(cpu, tsp, share(cpu, tsp)) == 4 * (16 * 64 / 8) * down_backward * 4  # TSP splits the tokens too
    gpu, tiled = run(TINY.replace(moe_kernel="xla"), hw=H100), run(TINY.replace(moe_kernel="tiled"), hw=hardware.profile("cpu"))
    for r in (gpu, tiled):
        assert memory.cpu_kernel_bytes(r, sizes, share(r, sizes)) == 0


def test_an_iteration_of_several_layers_keeps_copies_of_its_expert_weights_only_without_remat():
    sizes = mesh_sizes(data=8)
    hybrid = TINY.replace(num_hidden_layers=4, layer_pattern="LC")
    experts_by_hand = 3 * 4 * 64 * 32 * 4  # gate, up, down of one layer's 4 experts, fp32
    copies = memory.stored_weight_bytes(run(hybrid), sizes)
    assert copies == 4 * memory.expert_weights(run(hybrid), sizes) and copies > 4 * experts_by_hand
    assert memory.stored_weight_bytes(run(hybrid, remat="full"), sizes) == 0
    assert memory.stored_weight_bytes(run(TINY.replace(num_hidden_layers=4)), sizes) == 0  # one layer per unit
    unrolled = dataclasses.replace(run(TINY.replace(num_hidden_layers=4)), scan_unroll=2)  # two an iteration
    assert memory.stored_weight_bytes(unrolled, sizes) == copies
    assert memory.stored_weight_bytes(dataclasses.replace(unrolled, remat="dots"), sizes) == copies  # kept anyway
    assert memory.stored_weight_bytes(dataclasses.replace(unrolled, scan_unroll=1, remat="dots"), sizes) == 0


def test_a_one_iteration_layer_scan_holds_half_a_block_unless_it_unrolls_several():
    """Without remat XLA:CPU's backward holds one block's gradients beside the kept activations; a
    scan of one iteration of one block is inlined and reuses the kept buffers (half), but one
    iteration that unrolls several blocks (`tiny_cpu`'s scan_unroll=4) holds the whole block; under
    a remat policy the backward holds every block the iteration recomputes."""
    cpu = hardware.profile("cpu")
    s = share(run(hw=cpu), mesh_sizes(data=8))
    block = memory.block_bytes_per_token(run(hw=cpu), s)
    looped = run(TINY.replace(num_hidden_layers=4), hw=cpu)
    sliced = memory.backward_scores_per_token(looped, s)  # the probabilities copied out of the loop's stack
    assert sliced > 0 and memory.working_set_per_token(looped, s) == block + sliced
    one = run(TINY.replace(num_hidden_layers=1), hw=cpu)
    assert memory.working_set_per_token(one, s) == block / 2
    unrolled = dataclasses.replace(looped, scan_unroll=4)
    assert memory.scan_iterations(unrolled) == 1 and memory.working_set_per_token(unrolled, s) == block
    # Under a remat policy XLA:CPU recomputes every block of the iteration before its backward.
    recomputed = dataclasses.replace(looped, remat="dots")
    scores = memory.backward_scores_per_token(recomputed, s)
    one_unit = memory.working_set_per_token(recomputed, s) - scores
    doubled = dataclasses.replace(recomputed, scan_unroll=2)  # and each CCA layer's recomputed probabilities
    assert memory.backward_scores_per_token(doubled, s) == 2 * scores
    two_units = memory.working_set_per_token(doubled, s) - 2 * scores
    assert two_units == pytest.approx(2 * one_unit) and one_unit == pytest.approx(memory.CPU_RECOMPUTED_UNITS * block)
    # Under `moe` the MoE's named tensors are kept, not recomputed: out of the recomputed block.
    named = dataclasses.replace(looped, remat="moe")
    assert memory.working_set_per_token(named, s) - scores == pytest.approx(
        memory.CPU_RECOMPUTED_UNITS * (block - memory.moe_saved_bytes(named, s)))


def test_a_recomputed_xla_attention_holds_its_probabilities_and_their_gradient_on_a_cpu():
    """XLA:CPU's backward of a recomputed `xla` CCA layer holds 2.5 [heads, keys] fp32 sets per token,
    1.5 beyond the one the block counts; no set with a flash kernel, none without a CCA layer."""
    cpu, sizes = hardware.profile("cpu"), mesh_sizes(tsp=4, data=2)
    recomputed = run(TINY.replace(attention_kernel="xla"), hw=cpu, remat="full")
    s = share(recomputed, sizes)
    probabilities = s.heads * 64 * 4  # every key of the 64-token sequence, fp32
    assert memory.backward_scores_per_token(recomputed, s) == 1.5 * probabilities
    assert memory.working_set_per_token(recomputed, s) == pytest.approx(
        memory.CPU_RECOMPUTED_UNITS * memory.block_bytes_per_token(recomputed, s) + 1.5 * probabilities)
    flash = run(TINY.replace(attention_kernel="pallas"), hw=cpu, remat="full")
    linear_only = run(TINY.replace(attention_kernel="xla", layer_pattern="L"), hw=cpu, remat="full")
    assert memory.backward_scores_per_token(flash, s) == memory.backward_scores_per_token(linear_only, s) == 0


def test_the_update_is_the_peak_on_cpu_when_the_gradients_outweigh_the_activations():
    cpu = hardware.profile("cpu")
    m = memory.predict(run(batch=1, seq=8, hw=cpu), mesh_sizes())  # one device, 8 tokens: the weights dominate
    assert m.parts["update_copies"] == 2 * m.grad_bytes and "stored_activations" not in m.parts
    big = memory.predict(run(batch=64, seq=256, hw=cpu), mesh_sizes())
    assert "update_copies" not in big.parts and big.activation_bytes > 2 * big.grad_bytes
    # Measured on XLA:CPU only: a GPU's update is priced without the copies (its backward peaks)
    assert "update_copies" not in memory.predict(run(batch=1, seq=8, hw=H100), mesh_sizes()).parts


def test_accumulated_gradients_are_two_sets_in_the_backward_and_one_at_the_update():
    """The backward holds the running sum and this micro-batch's gradients; by the update the last
    micro-batch is in the sum (an H200's XLA at ZAYA1 width, 31 layers, 4 micro-batches: one set,
    benchmarks/gpu_memory_vs_explorer_h200.md)."""
    cpu = hardware.profile("cpu")
    one = memory.predict(run(batch=1, seq=8, hw=cpu), mesh_sizes())
    update = memory.predict(run(batch=2, seq=8, accum=2, hw=cpu), mesh_sizes())  # the weights dominate
    assert "update_copies" in update.parts and update.grad_bytes == one.grad_bytes
    backward = memory.predict(run(batch=128, seq=256, accum=2, hw=cpu), mesh_sizes())
    assert "update_copies" not in backward.parts and backward.grad_bytes == 2 * one.grad_bytes


def test_flops_are_the_models_plus_recomputation():
    r = run(remat="none", batch=8, seq=64)
    tokens = 8 * 64
    model = flops.training_flops_per_token(TINY, 64).total
    head = TINY.vocab_size * TINY.hidden_size
    hw = step_time.hardware_flops(r, mesh_sizes(), step_time.share(r, mesh_sizes()))
    assert hw == pytest.approx(tokens * (model + 2 * head))  # the chunked loss recomputes its logits
    full = run(remat="full", batch=8, seq=64)
    block_forward = 2 * (flops.matmul_params_per_token(TINY) - head) + flops.attention_flops_per_token(TINY, 64) / 3
    assert step_time.hardware_flops(full, mesh_sizes(), step_time.share(full, mesh_sizes())) == pytest.approx(
        hw + tokens * block_forward)  # full remat runs every block's forward twice


def test_tensor_splits_the_lm_heads_vocabulary_and_all_reduces_its_hidden_gradient_once_per_micro_batch():
    r = run(remat="none", batch=8, seq=64, accum=2)
    one, split = (step_time.hardware_flops(r, m, step_time.share(r, m)) for m in (mesh_sizes(), mesh_sizes(tensor=2)))
    # Per device (tensor splits no tokens): everything but the router halves, the head's 8·V·H per token too.
    assert inventory.vocab_split(TINY, mesh_sizes(tensor=2)) == 2 and inventory.vocab_split(TINY, mesh_sizes()) == 1
    repeated = 2 * flops.router_params(TINY) * TINY.num_hidden_layers * 3
    tokens = 8 * 64  # per step: 2 micro-batches of 4 x 64
    assert one - split == pytest.approx(tokens * ((one / tokens - repeated) / 2))
    loss = [t for t in step_time.transfers(r, mesh_sizes(tensor=2)) if "vocabulary-parallel" in t.what]
    assert len(loss) == 1 and loss[0].calls == 2 and loss[0].nbytes == 4 * 64 * TINY.hidden_size * 4
    chunk = min(r.vocab_chunk, TINY.vocab_size // 2)
    assert memory.loss_bytes(r, 100, 2) == 100 * (TINY.hidden_size * 4 + chunk * 2 * 4 + 8)  # fp32 compute


def test_a_gpus_loss_keeps_fp32_logits_and_their_gradient_in_the_compute_dtype():
    """At the loss-phase peaks of 8 deviceless H100s scheduling for a nearly full HBM (bf16, seeds 29
    and 34 at ZAYA1-like sizes) XLA holds one fp32 and one bf16 [tokens, chunk] buffer; XLA:CPU three fp32."""
    bf16 = run(cfg=preset("tiny", compute_dtype="bfloat16"), hw=hardware.profile("h100"))
    assert bf16.compute_bytes == 2
    chunk = min(bf16.vocab_chunk, bf16.cfg.vocab_size)
    assert memory.loss_bytes(bf16, 100) == 100 * (bf16.cfg.hidden_size * 4 + chunk * (4 + 2) + 8)
    cpu = run(cfg=preset("tiny"), hw=hardware.profile("cpu"))
    assert memory.loss_bytes(cpu, 100) == 100 * (cpu.cfg.hidden_size * 4 + chunk * 3 * 4 + 8)


def test_newton_schulz_runs_at_the_peak_of_its_products_dtype():
    """Muon's products are bf16 on GPUs by default (`optim.muon_ns_dtype=auto`): at the BF16 peak.
    In fp32 (as the H200 profile measured them: 50 TFLOP in 146 ms a step, 342 TFLOP/s) they run at
    the fp32 matmul peak: TF32 tensor cores on an H100 (half the BF16 peak), fp32 matrix cores under
    ROCm's XLA (an eighth on an MI300X). A GPU's GEMMs take the iterations' scalars and sums as
    alpha and addend (no elementwise pass); a host makes `NS_PASSES` passes an iteration."""
    sizes = mesh_sizes(data=8)
    for hw, fp32 in ((H100, 494.7), (MI300X, 163.4)):
        half, full = (dataclasses.replace(run(hw=hw), ns_dtype=d) for d in ("auto", "float32"))
        assert half.ns_in_bf16 and not full.ns_in_bf16
        ns = step_time.newton_schulz_flops(full, sizes) / (hw.compute_efficiency * 1e12)
        extra = step_time.optimizer_seconds(full, sizes) - step_time.optimizer_seconds(half, sizes)
        assert extra == pytest.approx(ns / fp32 - ns / hw.peak_bf16_tflops)
        assert extra > 0
    cpu = run(hw=hardware.profile("cpu"))
    assert not cpu.ns_in_bf16  # auto: fp32 on CPU, where the trajectory against PyTorch is exact
    on_gpu = dataclasses.replace(cpu, hw=dataclasses.replace(cpu.hw, target="cuda"), ns_dtype="float32")
    passes = step_time.NS_PASSES * cpu.ns_steps * sum(
        memory.ns_matrix_bytes(g, sizes) for g in inventory.param_groups(cpu.cfg) if g.optimizer == "muon")
    assert step_time.optimizer_seconds(cpu, sizes) - step_time.optimizer_seconds(on_gpu, sizes) == pytest.approx(
        passes / (cpu.hw.hbm_tb_per_s * 1e12))


def test_step_time_and_mfu_on_one_device_are_compute_and_optimizer():
    r = run(hw=hardware.profile("cpu"), batch=8, seq=64)
    r = Workload(r.cfg, r.seq_len, r.global_batch, r.grad_accum, r.remat, r.hw, 1, 1, r.vocab_chunk)
    t = step_time.predict(r, mesh_sizes(), Network(r.hw))
    assert t.exposed_comm_s == {}
    assert t.step_time_s == pytest.approx(t.compute_s + t.optimizer_s)
    # The nominal 1 TFLOP/s at efficiency 1, and the blocks' elementwise passes at its 0.1 TB/s
    s = step_time.share(r, mesh_sizes())
    made = 8 * 64 * TINY.num_hidden_layers * memory.block_bytes_per_token(r, s)
    copies = 2 * TINY.num_hidden_layers * step_time.tile_weight_bytes(r, mesh_sizes(), s)  # the tiled kernel's
    assert t.elementwise_s == pytest.approx((step_time.ELEMENTWISE_PASSES * made + copies) / 0.1e12)
    assert t.compute_s == pytest.approx(t.hardware_flops / 1e12 + t.elementwise_s)
    assert t.mfu == pytest.approx(t.model_flops / (t.step_time_s * 1e12))


def _gradient_transfers(r, sizes):
    return [tr for tr in step_time.transfers(r, sizes) if not tr.what.startswith("Muon")]


def test_gradients_reduce_over_the_axes_that_do_not_shard_them():
    r = run(batch=16, accum=4)
    grads = inventory.state_bytes(TINY, mesh_sizes()).grads
    # Over data once per step (parallel/grad_reduction.py), whatever the micro-batch count: ZeRO-1
    # reduce-scatters every gradient onto its optimizer shard and gathers the updated weights.
    # (A weight with no dimension that 8 divides keeps its state whole: all-reduced.)
    zero1 = {tr.op: tr for tr in _gradient_transfers(r, mesh_sizes(data=8))}
    assert set(zero1) == {"reduce_scatter", "all_gather", "all_reduce"} and {tr.axis for tr in zero1.values()} == {"data"}
    # One call per stacked weight, each priced at their mean size
    weights = len(inventory.param_groups(TINY))
    assert not any(tr.overlappable for tr in zero1.values())
    assert zero1["reduce_scatter"].calls + zero1["all_reduce"].calls == weights
    total = lambda tr: tr.nbytes * tr.calls
    assert total(zero1["reduce_scatter"]) + total(zero1["all_reduce"]) == pytest.approx(grads)
    assert zero1["all_gather"].calls == zero1["reduce_scatter"].calls
    assert total(zero1["all_gather"]) == pytest.approx(total(zero1["reduce_scatter"])) and total(
        zero1["all_gather"]) > 0.99 * grads
    whole, = _gradient_transfers(dataclasses.replace(r, zero1=False), mesh_sizes(data=8))
    assert (whole.axis, whole.op, whole.calls) == ("data", "all_reduce", weights)
    assert total(whole) == pytest.approx(grads)
    fsdp = _gradient_transfers(r, mesh_sizes(fsdp=8))
    ops = {(tr.axis, tr.op) for tr in fsdp}
    assert ("fsdp", "all_gather") in ops and ("fsdp", "reduce_scatter") in ops
    small = [tr for tr in fsdp if tr.op == "all_reduce"]  # router weights have no hidden dim to shard
    assert small and all(tr.axis == "fsdp" for tr in small)
    ep = {(tr.axis, tr.op) for tr in _gradient_transfers(r, mesh_sizes(expert=4, data=2))}
    assert ("expert", "all_gather") in ep and ("expert", "reduce_scatter") in ep


def test_muon_matrices_move_by_all_to_all_over_the_axes_inside_them_and_nothing_between():
    r = run(batch=16, accum=4)
    muon = [g for g in inventory.param_groups(TINY) if g.optimizer == "muon"]
    moves = lambda sizes: {(tr.axis, tr.op): tr for tr in step_time.transfers(r, sizes) if tr.what.startswith("Muon")}
    # tsp 8: a weight split inside its matrices (hidden or width) goes there and back as its shard,
    # padded to whole matrices (at most one more a device: the tile is padded to the 8 devices);
    # one the rules leave whole (the router's) is replicated: each device takes its part, and the
    # results are gathered. The bytes as compiled: tests/test_muon_spread.py. They move in the
    # iterations' dtype: bf16 on a GPU (half the fp32 state's bytes).
    assert r.ns_in_bf16
    sizes = mesh_sizes(tsp=8)
    tsp = moves(sizes)
    split = {g for g in muon if "tsp" in inventory.sharded_axes(g, sizes)}
    assert split and split != set(muon)
    # Four layers' router matrices over 8 devices: gathered they would be half padding, so they are
    # summed back (muon_spread.gathers_back).
    assert set(tsp) == {("tsp", "all_to_all"), ("tsp", "all_reduce")} and tsp["tsp", "all_to_all"].calls == 2
    shards = sum(g.count * inventory.local_bytes(g, sizes) for g in split) / 2
    assert shards <= tsp["tsp", "all_to_all"].nbytes <= shards + sum(inventory.matrix_bytes(g, 2) for g in split)
    assert tsp["tsp", "all_reduce"].nbytes == sum(g.count * inventory.local_bytes(g, sizes) for g in set(muon) - split) / 2
    fp32 = dataclasses.replace(r, ns_dtype="float32")
    assert {(tr.axis, tr.op): tr for tr in step_time.transfers(fp32, sizes)}["tsp", "all_reduce"].nbytes == \
        2 * tsp["tsp", "all_reduce"].nbytes
    # expert 4: the experts are split between whole matrices (nothing moves); the rest is replicated,
    # so each device takes its part and the results are gathered.
    sizes = mesh_sizes(expert=4)
    ep = moves(sizes)
    assert set(ep) == {("expert", "all_gather")}
    assert ep["expert", "all_gather"].nbytes >= sum(g.count * inventory.local_bytes(g, sizes)
                                                    for g in muon if g.part != "experts")


def test_exposed_communication_overlaps_only_where_the_schedule_allows():
    r = run(batch=64, seq=64)
    t = step_time.predict(r, mesh_sizes(tensor=2, data=4), Network(MI300X))
    assert t.exposed_comm_s["tensor"] > 0  # activations between dependent matmuls: never hidden
    net = Network(MI300X)
    cost = lambda trs: sum(tr.calls * net.time(tr.op, tr.nbytes, tr.span) for tr in trs)  # noqa: E731
    looped = run(batch=64, seq=64, accum=4)  # data's one reduction comes after the loop: nothing to hide behind
    after_loop = step_time.predict(looped, mesh_sizes(data=8), net)
    assert after_loop.exposed_comm_s["data"] == pytest.approx(cost(step_time.transfers(looped, mesh_sizes(data=8))))
    # One micro-batch: the reduction stays in the backward and hides; ZeRO-1's weight gather does not.
    one = step_time.predict(r, mesh_sizes(data=8), net)
    trs = step_time.transfers(r, mesh_sizes(data=8))
    assert {(tr.op, tr.overlappable) for tr in _gradient_transfers(r, mesh_sizes(data=8))} == {("all_reduce", True),
                                                                                       ("all_gather", False)}
    fixed, hideable = cost([tr for tr in trs if not tr.overlappable]), cost([tr for tr in trs if tr.overlappable])
    assert one.exposed_comm_s["data"] == pytest.approx(fixed + max(0.0, hideable - one.compute_s))
    hidden = step_time.predict(r, mesh_sizes(fsdp=8), net)  # FSDP's gathers and reductions overlap compute
    transfers = step_time.transfers(r, mesh_sizes(fsdp=8))
    assert all(tr.overlappable for tr in _gradient_transfers(r, mesh_sizes(fsdp=8)))
    fixed = cost([tr for tr in transfers if not tr.overlappable])  # Muon's exchange, after the backward
    assert fixed > 0 and all(tr.what.startswith("Muon") for tr in transfers if not tr.overlappable)
    total = cost([tr for tr in transfers if tr.overlappable])
    assert hidden.exposed_comm_s["fsdp"] == pytest.approx(fixed + max(0.0, total - hidden.compute_s))


def test_ranking_puts_fitting_layouts_first_fastest_first():
    preds = explore(run(batch=16))
    fits = [p for p in preds if p.fits]
    assert fits and preds[: len(fits)] == fits
    assert [p.time.step_time_s for p in fits] == sorted(p.time.step_time_s for p in fits)
    assert all(math.prod(p.layout.values()) == 8 for p in preds)
    assert not any(p.layout["tsp"] > 1 and p.layout["tensor"] > 1 for p in preds)  # check_layout's refusals hold


def test_layouts_within_the_measured_underestimate_of_the_limit_are_tight_and_ranked_after_the_sure_ones():
    totals = sorted(p.memory.total_bytes for p in explore(run(batch=16)))
    # The limit just above the median layout: some fit surely, some only as predicted, some not at all.
    usable = totals[len(totals) // 2] * 1.01
    hw = dataclasses.replace(MI300X, hbm_gb=usable / (1 - memory.HEADROOM) / 1e9)
    tight_run = run(hw=hw, batch=16)
    preds = explore(tight_run)
    sure = [p for p in preds if p.fits and not p.tight]
    tight = [p for p in preds if p.tight]
    assert sure and tight and len(sure) + len(tight) < len(preds)
    assert all(p.fits for p in tight)
    assert all(p.memory.total_bytes * memory.UNDERESTIMATE["gpu"] > usable for p in tight)
    assert all(p.memory.total_bytes * memory.UNDERESTIMATE["gpu"] <= usable for p in sure)
    assert preds[: len(sure) + len(tight)] == sure + tight  # each group fastest first
    assert [p.time.step_time_s for p in tight] == sorted(p.time.step_time_s for p in tight)
    cells = report.table(tight[:1] + sure[:1] + preds[-1:]).splitlines()[1:]
    assert [re.search(r"\s(tight|yes|no)\s", line).group(1) for line in cells] == ["tight", "yes", "no"]
    assert "check it with --validate" in report.tight_note(tight[0], tight_run)
    assert f"{memory.UNDERESTIMATE['gpu']:.2f}x" in report.tight_note(tight[0], tight_run) and report.tight_note(sure[0], tight_run) == ""
    assert tight[0].to_json()["tight"] and not sure[0].to_json()["tight"]


def test_no_layout_and_fits_nowhere_say_why_and_by_how_much():
    with pytest.raises(ZayaError, match=r"no layout of 3 devices .*most common reason"):
        explore(Workload(TINY, 64, 16, 1, "none", MI300X, 1, 3))
    big = Workload(preset("zaya1_base", compute_dtype="bfloat16"), 4096, 8, 1, "full", H100, 1, 1)
    preds = explore(big)
    assert not any(p.fits for p in preds)
    message = fits_nowhere_message(big, preds)
    assert "fits on no layout of 1 x 1 h100" in message and "more than the 67.1 GiB usable" in message
    over = preds[0].memory.total_bytes - memory.usable_bytes(big)
    assert f"{over / 1024 ** 3:.1f} GiB" in message
    assert message.endswith("add devices or raise train.grad_accum_steps")  # remat is full already
    assert fits_nowhere_message(dataclasses.replace(big, remat="dots"), preds).endswith("use train.remat=full")


MEASURED_CPU = dataclasses.replace(hardware.profile("cpu"), peak_bf16_tflops=0.2, hbm_tb_per_s=0.03,
                                   elementwise_tb_per_s=0.025, nominal=False,
                                   matmul_curve=((1e6, 0.01), (1e8, 0.1), (1e10, 0.2)))


def test_a_matmul_is_priced_at_the_measured_rate_of_its_size():
    curve = MEASURED_CPU.matmul_curve
    assert step_time.curve_rate(curve, 1e7) == pytest.approx(math.sqrt(0.01 * 0.1))  # log-log halfway
    assert step_time.curve_rate(curve, 1e5) == pytest.approx(0.001)  # below: the smallest call's time
    assert step_time.curve_rate(curve, 1e12) == 0.2  # above: the largest's rate
    r = run(hw=MEASURED_CPU, batch=8, seq=64)
    s = step_time.share(r, mesh_sizes())
    work = step_time.flops_by_kernel(r, mesh_sizes(), s)
    calls = step_time.call_flops(r, mesh_sizes(), s)
    assert calls["matmul"] == 2 * 8 * 64 * TINY.hidden_size ** 2
    # every (sequence, head)'s queries against its keys: one batched product
    assert calls["attention"] == 2 * 8 * TINY.num_attention_heads * 64 * 64 * TINY.head_dim
    # inside a step, the blocks' matmuls reach their measured share of the host's loop rate
    share = step_time.IN_STEP_MATMUL_SHARE
    want = sum(v / (share * step_time.curve_rate(curve, calls[k]) * 1e12) for k, v in work.items() if v)
    assert step_time.compute_seconds(r, work, calls) == pytest.approx(want)
    assert step_time.compute_seconds(r, work, calls, in_step=1.0) == pytest.approx(want * share)
    # A calibration's measured share wins over the curve for its kind
    calibrated = dataclasses.replace(r, efficiencies=(("matmul", 0.5),))
    assert step_time.compute_seconds(calibrated, {"matmul": 1e9}, calls) == pytest.approx(1e9 / 0.1e12)


def test_kernels_of_static_shape_run_every_row_the_device_holds():
    r = run(hw=MEASURED_CPU, batch=8, seq=64)  # the cpu target's default grouped matmul: tiled
    for sizes, owners in ((mesh_sizes(), 1), (mesh_sizes(expert=2), 2)):  # expert: the other owner's rows too
        s = step_time.share(r, sizes)
        rows = 8 * 64 / owners
        held = int(rows * owners)
        experts = TINY.num_experts // sizes["expert"]
        tile = tiled_grouped_matmul.tile_rows(held, experts)
        assert step_time.padded_share(r, sizes, s) == (held + experts * tile) / rows
        assert step_time.call_flops(r, sizes, s)["grouped_matmul"] == 2 * held / experts * TINY.hidden_size * \
            TINY.moe_intermediate_size
    xla = dataclasses.replace(TINY, moe_kernel="xla")  # XLA:CPU's ragged_dot: every row by every expert
    s = step_time.share(r, mesh_sizes())
    assert s.tokens == 8 * 64 and step_time.padded_share(dataclasses.replace(r, cfg=xla), mesh_sizes(), s) == TINY.num_experts
    gpu = run(cfg=xla, hw=H100, batch=8, seq=64)
    assert step_time.padded_share(gpu, mesh_sizes(), s) == 1.0
    pallas = run(hw=H100, batch=8, seq=64)
    assert step_time.padded_share(pallas, mesh_sizes(expert=2), step_time.share(pallas, mesh_sizes(expert=2))) == 1.0


def test_elementwise_work_is_passes_over_the_blocks_activations_and_a_forward_more_under_remat():
    sizes = mesh_sizes()
    xla = dataclasses.replace(TINY, moe_kernel="xla")  # no tiled weight copies: the blocks' passes alone
    for remat, forwards in (("none", 0), ("full", 1), ("dots", 1)):
        r = run(cfg=xla, hw=MEASURED_CPU, batch=8, seq=64, accum=2, remat=remat)
        s = step_time.share(r, sizes)
        made = TINY.num_hidden_layers * memory.block_bytes_per_token(r, s) * 8 * 64  # both micro-batches
        want = step_time.ELEMENTWISE_PASSES * (3 + forwards) / 3 * made / 0.025e12
        assert step_time.elementwise_seconds(r, sizes, s) == pytest.approx(want), remat
    # Without a measured elementwise rate, the memory bandwidth
    r = run(cfg=xla, hw=dataclasses.replace(MEASURED_CPU, elementwise_tb_per_s=0.0), batch=8, seq=64)
    s = step_time.share(r, sizes)
    assert step_time.elementwise_seconds(r, sizes, s) == pytest.approx(
        step_time.ELEMENTWISE_PASSES * TINY.num_hidden_layers * memory.block_bytes_per_token(r, s) * 512 / 0.03e12)


def test_the_tiled_grouped_matmul_writes_and_reads_a_copy_of_its_weights_per_tile():
    r = run(hw=MEASURED_CPU, batch=8, seq=64)  # tiled, the cpu target's default
    s = step_time.share(r, mesh_sizes())
    rows, experts = 512, TINY.num_experts
    tiles = rows / tiled_grouped_matmul.tile_rows(rows, experts) + experts
    per_layer = 2 * tiles * 3 * TINY.hidden_size * TINY.moe_intermediate_size * 4
    assert step_time.tile_weight_bytes(r, mesh_sizes(), s) == per_layer
    plain = dataclasses.replace(r, cfg=dataclasses.replace(TINY, moe_kernel="xla"))
    extra = step_time.elementwise_seconds(r, mesh_sizes(), s) - step_time.elementwise_seconds(plain, mesh_sizes(), s)
    assert extra == pytest.approx(2 * TINY.num_hidden_layers * per_layer / 0.025e12)  # forward and backward
    assert step_time.tile_weight_bytes(run(hw=H100, batch=8, seq=64), mesh_sizes(), s) == 0.0  # Pallas: none


def test_the_tsp_rings_backward_runs_the_experts_forward_again():
    """`parallel/tsp_experts.py`'s backward recomputes each slice's products from the tokens, whatever
    the remat policy: one more forward of the experts' matmuls, of their elementwise work, and of
    the tiled kernel's weight copies, whose ring steps copy a slice each (the whole width in all)."""
    for remat, forwards in (("none", 3), ("full", 4), ("moe", 3)):
        r = run(hw=MEASURED_CPU, remat=remat, batch=8, seq=64)
        data, tsp = mesh_sizes(data=2), mesh_sizes(tsp=2)
        plain = step_time.flops_by_kernel(r, data, step_time.share(r, data))["grouped_matmul"]
        ring = step_time.flops_by_kernel(r, tsp, step_time.share(r, tsp))["grouped_matmul"]
        padded = step_time.padded_share(r, tsp, step_time.share(r, tsp)) / step_time.padded_share(r, data, step_time.share(r, data))
        assert ring / padded == pytest.approx(plain * (forwards + 1) / forwards), remat
    r, sizes = run(hw=MEASURED_CPU, batch=8, seq=64), mesh_sizes(tsp=2)
    s = step_time.share(r, sizes)
    copies = step_time.tile_weight_bytes(r, sizes, s)
    assert copies == 2 * (256 / tiled_grouped_matmul.tile_rows(256, 4) + 4) * 3 * TINY.hidden_size * TINY.moe_intermediate_size * 4
    experts = TINY.num_hidden_layers * memory.moe_bytes(r, s)["experts"] * 256
    made = TINY.num_hidden_layers * memory.block_bytes_per_token(r, s) * 256
    want = (step_time.ELEMENTWISE_PASSES * (made + experts / 3) + 3 * TINY.num_hidden_layers * copies) / 0.025e12
    assert step_time.elementwise_seconds(r, sizes, s) == pytest.approx(want)


def test_collectives_hide_behind_compute_on_a_gpu_and_not_on_a_cpu():
    sizes = mesh_sizes(fsdp=8)
    for hw, hidden in ((H100, True), (MEASURED_CPU, False)):
        r = run(hw=hw, batch=64, seq=256)
        overlappable = [tr for tr in step_time.transfers(r, sizes) if tr.overlappable]
        assert overlappable  # FSDP's gathers and reductions
        t = step_time.predict(r, sizes, Network(hw))
        whole = sum(tr.calls * Network(hw).time(tr.op, tr.nbytes, tr.span) for tr in step_time.transfers(r, sizes))
        assert (sum(t.exposed_comm_s.values()) < whole) == hidden, hw.name


def test_a_cca_layer_split_along_the_sequence_keeps_its_input_with_the_look_back_rows():
    """Under tsp or sequence chunks the layer's input, the previous chunk's look-back rows in front,
    is kept in three copies on XLA:CPU (two beyond the normed copy every layer keeps): 2·H per token
    in the compute dtype; none where the sequence is whole, however the batch splits."""
    cpu = run(TINY, hw=hardware.profile("cpu"))
    for split in (mesh_sizes(sequence=2), mesh_sizes(tsp=2, data=4)):
        assert memory.attention_bytes(cpu, share(cpu, split))["look_back_input"] == 2 * 64 * 4
    for whole in (mesh_sizes(data=8), mesh_sizes(fsdp=4, tensor=2)):
        assert "look_back_input" not in memory.attention_bytes(cpu, share(cpu, whole))
    gpu = run(TINY, hw=H100)  # read off XLA:CPU's buffers only
    assert "look_back_input" not in memory.attention_bytes(gpu, share(gpu, mesh_sizes(sequence=2)))
