"""`zaya mesh` on hybrid models (`model.layer_pattern`): a linear-attention layer priced as it runs
(`parallel/linear_schedule.py`, `parallel/lasp2.py`) beside a CCA layer — its weights counted once per
linear layer, its FLOPs from `train/flops.py`, its LASP-2 state exchange in place of CCA's K/V
gather, its activations — and an all-CCA model priced to the byte as pinned numbers say (pricing
linear layers must not move a model that has none); one
layout compiled against XLA."""

import math
import os

import pytest

from zaya_jax import hardware
from zaya_jax.config import preset
from zaya_jax.explore import inventory, memory, step_time
from zaya_jax.explore.collectives import Network
from zaya_jax.explore.workload import Workload
from meshes import mesh_sizes
from zaya_jax.train import flops

TINY = preset("tiny", compute_dtype="float32")  # H 64, 4 heads / 2 KV of 16, 2 layers
HYBRID = TINY.replace(layer_pattern="LC")  # layer 0 linear attention, layer 1 CCA
H100 = hardware.profile("h100")


def run(cfg=HYBRID, seq=64, batch=16, remat="none", zigzag=True):
    return Workload(cfg, seq, batch, 1, remat, H100, 1, 8, vocab_chunk=64, zigzag=zigzag)


def by_what(r, sizes):
    return {(tr.axis, tr.op, tr.what): tr for tr in step_time.transfers(r, sizes)}


def test_stacked_weights_count_the_layers_of_their_kind_as_the_model_stores_them():
    from zaya_jax.model.state import expected_shapes
    from zaya_jax.train.flat_model import model_def

    cfg = TINY.replace(num_hidden_layers=8, layer_pattern="LLLC")
    shapes = model_def(cfg).param_shapes
    groups = inventory.param_groups(cfg)
    for g in groups:
        if g.path.startswith("layers/"):
            assert tuple(shapes[g.path]) == (g.count, *g.shape), g.path
    counts = {g.path: g.count for g in groups}
    assert counts["layers/attn/wq"] == 2 and counts["layers/linear_attn/wq"] == 6
    assert counts["layers/moe/router/fc1"] == 8
    biases, inert = 8 * (cfg.num_experts + 1), cfg.router_hidden_size  # as test_state_bytes_by_hand
    total = sum(g.count * g.elements for g in groups)
    assert total == sum(math.prod(s) for s in expected_shapes(cfg).values()) - biases + inert
    assert inventory.state_bytes(cfg, mesh_sizes()).grads == 4 * total


def test_an_all_cca_pattern_prices_exactly_as_before_hybrid_pricing():
    # (total bytes, hardware FLOPs, step seconds) per device, pinned from the all-CCA explorer: pricing
    # linear-attention layers must leave a model without them exactly where it was. (Totals re-pinned
    # when the memory model gained the experts' backward weights, the CPU ragged_dot operands and the
    # update's peak, all of which an all-CCA model has too; step times re-pinned when the step model
    # gained the blocks' elementwise work and one gradient collective per stacked weight; TSP's FLOPs
    # when it gained the ring backward's second forward of the experts; step times when Muon's
    # Newton–Schulz moved to the fp32 matmul peak, which an all-CCA model runs too; totals when the
    # loss's working set became a phase of its own, beside no block's; data 8's when one micro-batch's
    # gradients became ZeRO-1's shards; `none`'s when a GPU's backward without remat held one block;
    # tsp 8's step times when the expert ring's last step joined its loop, a hop more each way; tsp 8's
    # totals when the embedding gathered for the loss left the blocks' backward; `dots`' totals when
    # it kept what JAX saves: not the experts' grouped-matmul outputs, each block's input; step times
    # when Muon's exchange was priced as compiled: padded tiles, the sum back where a gather would pad;
    # totals when a GPU's block was priced as the layer scan saves it: the router's fp32 rows, the
    # experts' fp32 gate/up; step times when Newton–Schulz's products became bf16 on GPUs, which an
    # all-CCA model runs too; step times when a GPU's Newton–Schulz took its scalars and sums into its
    # GEMMs, which an all-CCA model's does too, and when its matrices moved in bf16.)
    before = [
        ("none", mesh_sizes(data=8), 3255400.0, 58875904.0, 0.000891945098574421),
        ("none", mesh_sizes(tsp=8), 4085704.0, 62021632.0, 0.0006771190516189543),
        ("none", mesh_sizes(sequence=8), 5104440.0, 58875904.0, 0.0006381304839985201),
        ("none", mesh_sizes(tensor=2, sequence=4), 5221144.0, 61358080.0, 0.0008127855586480366),
        ("dots", mesh_sizes(data=8), 2748008.0, 60973056.0, 0.000891945098574421),
        ("dots", mesh_sizes(tsp=8), 2931144.0, 64118784.0, 0.0006771190516189543),
        ("dots", mesh_sizes(sequence=8), 4072760.0, 60973056.0, 0.0006381304839985201),
        ("dots", mesh_sizes(tensor=2, sequence=4), 4224792.0, 63455232.0, 0.0008127855586480366),
    ]
    for remat, sizes, total, work, seconds in before:
        r = run(TINY, remat=remat)
        t = step_time.predict(r, sizes, Network(H100))
        assert (memory.predict(r, sizes).total_bytes, t.hardware_flops) == (total, work), (remat, sizes)
        assert t.step_time_s == pytest.approx(seconds, rel=1e-12)  # summed over a set of axes: any order


def test_a_linear_layers_sequence_exchange_is_the_state_all_gather_whatever_the_sequence_length():
    sizes = mesh_sizes(sequence=8)
    short, long = (by_what(run(seq=s), sizes) for s in (64, 256))
    # fp32 [2·8 zigzag chunks, 16 sequences, 2 KV heads, 2 query heads each, 16, 16]
    states = 16 * 16 * 2 * 2 * 16 * 16 * 4
    for trs in (short, long):
        gather = trs["sequence", "all_gather", "linear layers' memory states"]
        back = trs["sequence", "reduce_scatter", "linear layers' state gradients"]
        ends = trs["sequence", "all_gather", "linear layers' chunk ends"]
        assert gather.nbytes == back.nbytes == states and ends.nbytes == 16 * 16 * 4
        assert (gather.calls, back.calls, ends.calls) == (1, 1, 1)  # one linear layer, remat none
        kv = trs["sequence", "all_gather", "K/V along the sequence"]
        assert kv.calls == 1  # the one CCA layer's: no K/V for the linear one
    kv = lambda trs: trs["sequence", "all_gather", "K/V along the sequence"].nbytes  # noqa: E731
    assert kv(long) == 4 * kv(short)
    contiguous = by_what(run(zigzag=False), sizes)["sequence", "all_gather", "linear layers' memory states"]
    assert contiguous.nbytes == states / 2  # one chunk per device
    both = by_what(run(), mesh_sizes(tsp=2, sequence=4))  # one exchange over both sequence axes
    assert both["tsp+sequence", "all_gather", "linear layers' memory states"].nbytes == states
    assert not [tr for tr in step_time.transfers(run(), mesh_sizes(data=8)) if "linear layers" in tr.what]


def test_under_tsp_each_layer_gathers_its_own_mixers_weights():
    trs = by_what(run(), mesh_sizes(tsp=8))
    linear = 4 * (2 * 64 * 4 * 16 + 2 * 64 * 2 * 16 + 4 * 16 * 64 + 4 * 16)  # wq wg, wk wv, wo, out_norm (fp32)
    cca = sum(inventory.local_bytes(g, mesh_sizes(tsp=8), ("fsdp", "tsp")) for g in inventory.mixer_groups(HYBRID, "C"))
    assert trs["tsp", "all_gather", "linear-attention weight buckets"].nbytes == linear
    assert trs["tsp", "reduce_scatter", "linear-attention weight gradients"].nbytes == linear
    assert trs["tsp", "all_gather", "attention weight buckets"].nbytes == cca != linear
    for what in ("attention weight buckets", "linear-attention weight buckets"):
        assert trs["tsp", "all_gather", what].calls == 1  # one layer of each kind, remat none
    assert trs["tsp", "all_gather", "linear layers' memory states"].calls == 1


def test_tensor_all_reduces_a_linear_layers_output_like_a_cca_layers():
    sizes = mesh_sizes(tensor=2, data=4)
    pick = lambda cfg: [tr for tr in step_time.transfers(run(cfg), sizes)  # noqa: E731
                        if (tr.axis, tr.op) == ("tensor", "all_reduce") and "outputs" in tr.what]
    out, = pick(HYBRID)
    assert pick(TINY) == [out] and out.calls == 2 * 2 * 2  # 2 layers x (attention, experts) x (fwd, bwd)


def test_a_linear_layers_flops_are_its_own_and_its_core_has_no_sequence_length_or_imbalance():
    per_token = lambda r, sizes: step_time.hardware_flops(r, sizes, step_time.share(r, sizes)) / (  # noqa: E731
        r.micro_batch * r.seq_len / math.prod(sizes[a] for a in ("data", "fsdp", "expert", "tsp", "sequence")))
    one = mesh_sizes()
    linear, cca = TINY.replace(layer_pattern="L"), TINY
    # remat none: 3 block forwards per token; a layer is 2·(mixer + expert + router) + core/3, and a
    # linear layer's chunked kernel adds its chunks' scores and their products (4·C·nq·d).
    chunks = 4 * step_time.linear_chunk(run(linear)) * TINY.num_attention_heads * TINY.head_dim
    gap = 3 * 2 * (2 * (flops.layer_mixer_params(TINY, "C") - flops.layer_mixer_params(TINY, "L"))
                   + (flops.layer_core_flops(TINY, "C", 64) - flops.layer_core_flops(TINY, "L", 64)) / 3 - chunks)
    assert per_token(run(cca), one) - per_token(run(linear), one) == pytest.approx(gap, rel=1e-12)
    assert per_token(run(linear, seq=256), one) == per_token(run(linear), one)  # no S in its core (C ≤ S)
    assert per_token(run(cca, seq=256), one) > per_token(run(cca), one)
    # Contiguous chunks load the last device with (2D−1)/D of CCA's causal core; no linear layer's.
    sizes = mesh_sizes(sequence=8)
    assert per_token(run(linear, zigzag=False), sizes) == pytest.approx(per_token(run(linear), sizes), rel=1e-12)
    extra = 3 * flops.layer_core_flops(TINY, "C", 64) / 3 * (15 / 8 - 1)  # the hybrid's one CCA layer
    assert per_token(run(zigzag=False), sizes) - per_token(run(), sizes) == pytest.approx(extra, rel=1e-12)


def test_a_linear_layer_keeps_its_own_activations_and_its_gathered_states():
    sizes = mesh_sizes(sequence=8)
    short, long = run(), run(seq=256)
    s = step_time.share(short, sizes)
    states = 16 * 16 * 2 * 2 * 16 * 16 * 4
    linear = memory.linear_bytes(short, s)  # H100: the Pallas kernel, whose backward rebuilds the states
    assert set(linear) == {"input", "projections", "feature_map", "attention_out", "gate", "merge"}
    chunked = memory.linear_bytes(run(HYBRID.replace(linear_kernel="xla")), s)
    assert chunked["chunks"] == 2 * 4 * 64 * 4 + 2 * 4 * 16 * 16 * 4 / 64  # [C, C] scores and weights; 2 states / C
    assert memory.gathered_per_layer(short, sizes, s, "L") == states
    for r in (short, long):
        m = memory.predict(r, sizes)
        share = step_time.share(r, sizes)
        assert m.parts["gathered_states"] == 2 * states  # the same at 4x the sequence
        assert m.parts["gathered_kv"] == 2 * memory.gathered_kv_bytes(r, sizes, share)
        assert m.parts["stored_activations"] == share.tokens * (
            memory.block_bytes_per_token(r, share, "L") + memory.block_bytes_per_token(r, share, "C"))
        assert m.parts["stored_gathered"] == states + memory.gathered_kv_bytes(r, sizes, share)
    assert memory.predict(long, sizes).parts["gathered_kv"] == 4 * memory.predict(short, sizes).parts["gathered_kv"]


@pytest.mark.slow
def test_a_hybrids_predicted_memory_is_within_the_usual_band_of_xla():
    from zaya_jax.experiment import load_experiment
    from zaya_jax.explore.placement import describe
    from zaya_jax.explore.against_xla import validate

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments",
                          "tiny_hybrid_cpu.py")
    overrides = ["--config.train.seq_len=64", "--config.train.global_batch_size=8"]
    sizes = mesh_sizes(sequence=8)  # LASP-2 on three linear layers, K/V gathered on the CCA one
    got = validate(config, overrides, [sizes], progress=lambda m: None)[describe(sizes)]
    predicted = memory.predict(Workload.from_experiment(load_experiment(config, overrides), hardware.profile("cpu"), 1, 8),
                               sizes)
    assert got["argument_bytes"] == pytest.approx(predicted.param_bytes + predicted.optimizer_bytes, rel=0.02)
    assert predicted.total_bytes == pytest.approx(got["argument_bytes"] + got["temp_bytes"], rel=0.2)


def test_a_linear_layers_chunked_kernel_prices_its_chunks_scores_at_its_backends_chunk():
    """Inside a chunk of C tokens the kernel forms the [C, C] scores and their product with the
    values: 4·C·nq·d FLOPs a token, forward. C is Pallas's block for the device and dtype (the
    H100's fp32 row: 32), never longer than the sequence rounded up to a power of two, or the
    `xla` form's 64 (the sequence, when shorter)."""
    nq_d = HYBRID.num_attention_heads * HYBRID.head_dim
    pallas = run(HYBRID.replace(linear_kernel="pallas"))
    assert step_time.linear_chunk(pallas) == 32 and step_time.intra_chunk_flops(pallas) == 4 * 32 * nq_d
    assert step_time.linear_chunk(run(HYBRID.replace(linear_kernel="pallas"), seq=20)) == 32
    assert step_time.linear_chunk(run(HYBRID.replace(linear_kernel="pallas", compute_dtype="bfloat16"))) == 64
    assert step_time.linear_chunk(run(HYBRID.replace(linear_kernel="xla"))) == 64
    assert step_time.linear_chunk(run(HYBRID.replace(linear_kernel="xla"), seq=48)) == 48
    # In training (remat none): three forwards' worth, one linear layer, the device's tokens.
    r, sizes = run(HYBRID.replace(linear_kernel="xla")), mesh_sizes(data=8)
    linear = step_time.flops_by_kernel(r, sizes, step_time.share(r, sizes))["linear_attention"]
    recurrent = flops.layer_core_flops(HYBRID, "L", 64)  # training FLOPs of the q·M and kᵀv form
    assert linear == pytest.approx((recurrent + 3 * 4 * 64 * nq_d) * 16 * 64 / 8)


def test_lasp2_adds_its_state_reduction_and_the_entering_states_read_on_a_split_sequence():
    """`parallel/lasp2.py` runs `chunk_state` (each query head's kᵀv over the device's chunks) and
    the kernel reads the entering state (q·M) on top of the kernel's own work: 2·d² FLOPs per query
    head and token each, forward; three times that in training. An unsplit sequence has neither."""
    r = run(remat="none")
    linear = lambda sizes: step_time.flops_by_kernel(r, sizes, step_time.share(r, sizes))["linear_attention"]  # noqa: E731
    tokens = 16 * 64 / 2
    extra = 3 * (2 + 2) * HYBRID.num_attention_heads * HYBRID.head_dim ** 2 * tokens  # one linear layer
    assert linear(mesh_sizes(sequence=2)) == pytest.approx(linear(mesh_sizes(data=2)) + extra)
    assert linear(mesh_sizes(tsp=2)) == pytest.approx(linear(mesh_sizes(data=2)) + extra)
