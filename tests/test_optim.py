"""The optimizer: Muon's update is near-orthogonal and RMS-matched; every parameter is where the recipe says."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zaya_jax.config import preset
from zaya_jax.errors import ZayaError
from zaya_jax.experiment import base_config
from zaya_jax.train.flat_model import model_def
from zaya_jax.train.muon import MatrixView, MuonState, newton_schulz, ns_dtype, orthogonal_update, scale_by_muon
from zaya_jax.train.optim import build_optimizer, learning_rate_schedule, rule_for, warmup_steps


@pytest.mark.parametrize("shape", [(64, 64), (32, 96), (96, 32), (4, 24, 40)])
def test_newton_schulz_is_near_orthogonal(shape):
    g = jax.random.normal(jax.random.key(0), shape)
    x = newton_schulz(g, steps=5)
    sv = np.linalg.svd(np.asarray(x), compute_uv=False)
    # Quintic NS trades exactness for speed: singular values land in ~[0.7, 1.2], never near 0.
    assert sv.min() > 0.6 and sv.max() < 1.25, (sv.min(), sv.max())
    # Same singular vectors as the exact polar factor U Vᵀ: strong alignment.
    u, _, vt = np.linalg.svd(np.asarray(g), full_matrices=False)
    polar = u @ vt
    cos = np.sum(np.asarray(x) * polar, axis=(-2, -1)) / (
        np.linalg.norm(np.asarray(x), axis=(-2, -1)) * np.linalg.norm(polar, axis=(-2, -1)))
    assert np.all(cos > 0.97)


@pytest.mark.parametrize("shape", [(64, 64), (64, 256), (256, 64), (4, 96, 160)])
def test_bf16_newton_schulz_is_near_orthogonal_and_near_the_fp32_one(shape):
    g = jax.random.normal(jax.random.key(5), shape)
    half = newton_schulz(g, steps=5, dtype=jnp.bfloat16)
    assert half.dtype == jnp.bfloat16
    half = np.asarray(half, np.float32)
    full = np.asarray(newton_schulz(g, steps=5))
    sv = np.linalg.svd(half, compute_uv=False)
    assert sv.min() > 0.6 and sv.max() < 1.25, (sv.min(), sv.max())
    # bf16 keeps 8 significant bits; five iterations of three rounded products stay within a few %.
    err = np.linalg.norm(half - full, axis=(-2, -1)) / np.linalg.norm(full, axis=(-2, -1))
    assert np.all(err < 0.03), err


@pytest.mark.parametrize("shape", [(96, 96), (48, 160), (160, 48)])
def test_bf16_newton_schulz_tracks_torch_optim_muons(shape):
    """torch.optim.Muon's own Newton–Schulz (bf16, as shipped) on the same matrix: the same
    iteration, rounded alike up to where each library rounds its products."""
    torch = pytest.importorskip("torch")
    from torch.optim import _muon

    g = np.asarray(jax.random.normal(jax.random.key(6), shape))
    theirs = _muon._zeropower_via_newtonschulz(torch.tensor(g), (3.4445, -4.7750, 2.0315), 5, 1e-7)
    theirs = theirs.float().numpy()
    ours = np.asarray(newton_schulz(jnp.asarray(g), steps=5, dtype=jnp.bfloat16), np.float32)
    full = np.asarray(newton_schulz(jnp.asarray(g), steps=5))
    rel = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
    # Each side rounds its own products (XLA's and torch's bf16 GEMMs round differently), so the two
    # bf16 results differ by about twice what either differs from the fp32 iteration (1-2%): 2-3%.
    # A wrong coefficient or a missing normalisation moves them 30% and more apart.
    assert rel < 0.04, rel
    assert np.linalg.norm(ours - full) / np.linalg.norm(full) < 0.03


def test_newton_schulz_runs_in_bf16_on_gpu_targets_and_fp32_on_cpu():
    assert [ns_dtype("auto", t) for t in ("cuda", "rocm", "cpu", None)] == ["bfloat16", "bfloat16", "float32", "float32"]
    assert ns_dtype("float32", "cuda") == "float32" and ns_dtype("bfloat16", "cpu") == "bfloat16"
    params = {"layers/experts/gate": jnp.ones((2, 3, 16, 8))}

    def product_dtypes(target):
        optim = base_config().optim
        tx = build_optimizer(optim, 10, {"layers/experts/gate": ("layers", "experts", None, None)}, target=target)[0]
        jaxpr = jax.make_jaxpr(lambda g, s: tx.update(g, s, params))(params, tx.init(params))
        return {str(e.invars[0].aval.dtype) for e in _equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"}

    assert product_dtypes("cuda") == {"bfloat16"}
    assert product_dtypes("cpu") == {"float32"}



@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_direction_reaches_the_spread_in_the_iterations_dtype(dtype):
    """The matrices go to the devices that orthogonalise them (and their momentum's pass writes them)
    in the dtype the iterations run in: bf16 on GPUs, half the bytes of the fp32 state."""
    seen = []

    def spread(fn, mats, key):
        seen.append(mats.dtype)
        return fn(mats)

    m = jax.random.normal(jax.random.key(0), (2, 16, 8))
    out = orthogonal_update(m, MatrixView(batch_axes=1), 5, 0.2, spread, "w", dtype)
    assert seen == [jnp.dtype(dtype)] and out.dtype == m.dtype

def _equations(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for sub in jax.core.subjaxprs(e) if hasattr(jax.core, "subjaxprs") else ():
            yield from _equations(sub)
        for value in e.params.values():
            inner = getattr(value, "jaxpr", None)
            if inner is not None:
                yield from _equations(getattr(inner, "jaxpr", inner))


@pytest.mark.parametrize("shape, view", [
    ((64, 256), MatrixView(0, 1)),  # wide matrix
    ((64, 4, 16), MatrixView(0, 1)),  # wq-like [H, nq, d]
    ((4, 16, 64), MatrixView(0, 2)),  # wo-like [nq, d, H]
    ((4, 64, 32), MatrixView(1, 1)),  # stacked experts [E, H, I]
])
def test_muon_update_rms_matches_adamw(shape, view):
    g = jax.random.normal(jax.random.key(1), shape)
    update = orthogonal_update(g, view, steps=5, rms=0.2)
    rms = float(jnp.sqrt(jnp.mean(update ** 2)))
    # Exactly 0.2 for an exactly orthogonal factor; quintic NS leaves singular values in ~[0.7, 1.2].
    assert 0.16 < rms < 0.24, rms


def test_experts_are_orthogonalised_one_by_one():
    g = jax.random.normal(jax.random.key(2), (3, 16, 32))
    g = g.at[1].multiply(100.0)  # a huge expert must not shrink the others' updates
    update = orthogonal_update(g, MatrixView(1, 1), steps=5, rms=0.2)
    per_expert = jnp.sqrt(jnp.mean(update ** 2, axis=(1, 2)))
    np.testing.assert_allclose(per_expert, 0.2, rtol=0.15)
    np.testing.assert_allclose(update[0], orthogonal_update(g[0], MatrixView(0, 1), 5, 0.2), rtol=1e-5, atol=1e-6)


def test_muon_momentum():
    tx = scale_by_muon({"w": MatrixView()}, momentum=0.9, nesterov=False)
    params = {"w": jnp.ones((8, 8))}
    state = tx.init(params)
    g = jax.random.normal(jax.random.key(3), (8, 8))
    _, state = tx.update({"w": g}, state, params)
    np.testing.assert_allclose(state.momentum["w"], 0.1 * g, rtol=1e-6)


def _optimizer(params, **changes):
    optim = base_config().optim
    optim.unlock()
    optim.update(warmup_steps=0, lr=1.0, min_lr=1.0, **changes)
    return build_optimizer(optim, 10, axes_of(params))[0]


def axes_of(params):
    """Logical axes as the model gives them: stacked block weights lead with `layers`."""
    return {k: (("layers",) if k.startswith("layers/") else ()) + (None,) * (v.ndim - k.startswith("layers/"))
            for k, v in params.items()}


def test_muon_skips_the_leaves_adamw_owns():
    params = {"layers/attn/wq": jnp.ones((3, 16, 2, 8)), "final_norm/weight": jnp.ones((16,))}
    tx = _optimizer(params, clip_norm=0.0, weight_decay=0.0)
    state = tx.init(params)
    [muon] = [s for s in jax.tree_util.tree_leaves(state, is_leaf=lambda s: isinstance(s, MuonState))
              if isinstance(s, MuonState)]
    assert muon.momentum["layers/attn/wq"].shape == (3, 16, 2, 8)
    assert isinstance(muon.momentum["final_norm/weight"], optax.MaskedNode)  # no momentum, no Newton–Schulz
    grads = {"layers/attn/wq": jnp.ones((3, 16, 2, 8)), "final_norm/weight": jnp.full((16,), 3.0)}
    updates, _ = tx.update(grads, state, params)
    np.testing.assert_allclose(updates["final_norm/weight"], -1.0, rtol=1e-6)  # AdamW's first step: -lr·sign(g)


EXPECTED = {
    "embedding": ("adamw", True),
    "final_norm/weight": ("adamw", False),
    "input_affine/scale": ("adamw", False),
    "input_affine/bias": ("adamw", False),
    "layers/attn/wq": ("muon", True),
    "layers/attn/wk": ("muon", True),
    "layers/attn/wv_current": ("muon", True),
    "layers/attn/wv_delayed": ("muon", True),
    "layers/attn/wo": ("muon", True),
    "layers/attn/conv_depthwise": ("adamw", True),
    "layers/attn/conv_grouped": ("adamw", True),
    "layers/attn/conv_grouped_bias": ("adamw", False),
    "layers/attn/temperature": ("adamw", False),
    "layers/attn_norm/weight": ("adamw", False),
    "layers/attn_merge/branch/scale": ("adamw", False),
    "layers/mlp_merge/residual/bias": ("adamw", False),
    "layers/moe/router/down": ("muon", True),
    "layers/moe/router/down_bias": ("adamw", False),
    "layers/moe/router/eda_scale": ("adamw", False),
    "layers/moe/router/fc1": ("muon", True),
    "layers/moe/router/out": ("muon", True),
    "layers/moe/router/norm/weight": ("adamw", False),
    "layers/moe/experts/gate": ("muon", True),
    "layers/moe/experts/up": ("muon", True),
    "layers/moe/experts/down": ("muon", True),
}


def test_partition_puts_each_parameter_where_the_recipe_says():
    paths = model_def(preset("tiny")).param_axes
    for path in paths:  # every parameter has a rule
        rule_for(path)
    for path, (optimizer, decay) in EXPECTED.items():
        assert path in paths
        rule = rule_for(path)
        assert (rule.optimizer, rule.decay) == (optimizer, decay), path
    assert rule_for("layers/moe/experts/down").view == MatrixView(1, 1)
    assert rule_for("layers/attn/wo").view == MatrixView(0, 2)
    with pytest.raises(ZayaError, match="no optimizer rule"):
        rule_for("layers/attn/mystery")


def test_optimizer_applies_muon_and_adamw_per_partition():
    optim = base_config().optim
    optim.unlock()
    optim.update(clip_norm=0.0, weight_decay=0.0, warmup_steps=0)
    params = {"layers/attn/wq": jnp.zeros((3, 16, 2, 8)), "final_norm/weight": jnp.zeros((16,))}
    tx, schedule = build_optimizer(optim, 10, axes_of(params))
    grads = {"layers/attn/wq": jax.random.normal(jax.random.key(4), (3, 16, 2, 8)),
             "final_norm/weight": jax.random.normal(jax.random.key(5), (16,))}
    updates, _ = tx.update(grads, tx.init(params), params)
    lr = float(schedule(0))
    # AdamW's first update is -lr·sign(g); Muon's has RMS lr·0.2.
    np.testing.assert_allclose(updates["final_norm/weight"], -lr * np.sign(grads["final_norm/weight"]), rtol=1e-4)
    for layer in updates["layers/attn/wq"]:
        np.testing.assert_allclose(float(jnp.sqrt(jnp.mean(layer ** 2))), 0.2 * lr, rtol=0.15)


def test_muon_orthogonalises_each_layer_of_a_stacked_weight_on_its_own():
    optim = base_config().optim
    optim.unlock()
    optim.update(clip_norm=0.0, weight_decay=0.0, warmup_steps=0)
    grads = jax.random.normal(jax.random.key(6), (3, 16, 2, 8))
    stacked_tx, _ = build_optimizer(optim, 10, {"layers/attn/wq": ("layers", "embed", "heads", "head_dim")})
    single_tx, _ = build_optimizer(optim, 10, {"attn/wq": ("embed", "heads", "head_dim")})
    params = {"layers/attn/wq": jnp.zeros((3, 16, 2, 8))}
    stacked, _ = stacked_tx.update({"layers/attn/wq": grads}, stacked_tx.init(params), params)
    for i in range(3):
        one = {"attn/wq": jnp.zeros((16, 2, 8))}
        alone, _ = single_tx.update({"attn/wq": grads[i]}, single_tx.init(one), one)
        np.testing.assert_allclose(stacked["layers/attn/wq"][i], alone["attn/wq"], rtol=1e-5, atol=1e-7)


def test_schedule_warmup_then_cosine():
    optim = base_config().optim
    optim.unlock()
    optim.update(lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=0)
    schedule = learning_rate_schedule(optim, total_steps=110)
    assert float(schedule(0)) == 0.0 and abs(float(schedule(5)) - 0.5) < 1e-6
    assert abs(float(schedule(10)) - 1.0) < 1e-6 and abs(float(schedule(110)) - 0.1) < 1e-6
    assert abs(float(schedule(60)) - 0.55) < 1e-6  # cosine midpoint


def test_weight_decay_mask():
    params = {"embedding": jnp.ones((4, 4)), "final_norm/weight": jnp.ones((4,))}
    tx = _optimizer(params, clip_norm=1.0, weight_decay=0.5, b1=0.0, b2=0.0)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, tx.init(params), params)
    np.testing.assert_allclose(updates["embedding"], -0.5 * np.ones((4, 4)), rtol=1e-6)  # decayed
    np.testing.assert_allclose(updates["final_norm/weight"], 0.0)  # never decayed


@pytest.mark.parametrize("clip_norm, expected", [(1.0, -1 / 3), (0.0, -100 / 101)])
def test_gradients_are_clipped_to_the_global_norm_before_adamw(clip_norm, expected):
    """With eps = 1 and b1 = b2 = 0, AdamW's step is -g/(|g| + 1): it shows the gradient's size.
    Four gradients of 100 (global norm 200) clipped to norm 1 are 0.5 each: -0.5/1.5."""
    params = {"final_norm/weight": jnp.ones((4,))}
    tx = _optimizer(params, clip_norm=clip_norm, weight_decay=0.0, b1=0.0, b2=0.0, eps=1.0)
    updates, _ = tx.update({"final_norm/weight": jnp.full((4,), 100.0)}, tx.init(params), params)
    np.testing.assert_allclose(updates["final_norm/weight"], expected, rtol=1e-5)


@pytest.mark.parametrize("steps, warmup, used", [(3, 30, 0), (100, 300, 10), (100, 30, 30), (31, 30, 30)])
def test_a_warmup_longer_than_the_run_is_shortened_to_a_tenth_of_it(steps, warmup, used):
    optim = base_config().optim
    optim.unlock()
    optim.update(lr=1.0, min_lr=0.0, warmup_steps=warmup, decay_steps=0)
    assert warmup_steps(optim, steps) == used
    schedule = learning_rate_schedule(optim, total_steps=steps)
    assert abs(float(schedule(used)) - 1.0) < 1e-6  # the peak is reached where the warmup ends


# ---------------------------------------------------------------------------------------------
# A few real Muon steps (Nesterov, weight decay, schedule) against the algorithm written out in float64.

NS_ABC = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (github.com/KellerJordan/Muon)
MUON_SHAPES = {  # a tall per-layer matrix and a wide per-expert one, both stacked over 2 layers
    "layers/attn/wq": (2, 12, 2, 3),  # [L, H, nq, d]: each layer is [12, 6]
    "layers/moe/experts/down": (2, 3, 5, 8),  # [L, E, I, H]: each expert of each layer is [5, 8]
}
MUON_BATCH = {"layers/attn/wq": 1, "layers/moe/experts/down": 2}  # leading axes that index separate matrices
MUON_RUN = dict(momentum=0.9, wd=0.1, peak=0.02, end=0.002, warmup=2, total=6, steps=5)


def _ns5_float64(g):
    """The quintic Newton–Schulz as published: on the wide orientation, Frobenius-normalised first."""
    a, b, c = NS_ABC
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / max(np.linalg.norm(x), 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def _lr_float64(step, peak, end, warmup, total):
    """Linear warmup from 0, then cosine from `peak` to `end` at `total`."""
    if step < warmup:
        return peak * step / warmup
    return end + (peak - end) * 0.5 * (1 + np.cos(np.pi * (step - warmup) / (total - warmup)))


@functools.cache  # both tests below read the same run; one optimizer compile
def _muon_run(nesterov, momentum, wd, peak, end, warmup, total, steps):
    """(our updates, float64 reference updates, the matrices' starting params, the gradients), step by step."""
    rng = np.random.RandomState(7)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in MUON_SHAPES.items()}
    grads = [{k: rng.normal(size=s).astype(np.float32) for k, s in MUON_SHAPES.items()} for _ in range(steps)]
    optim = base_config().optim
    optim.unlock()
    optim.update(lr=peak, min_lr=end, warmup_steps=warmup, decay_steps=0, weight_decay=wd, clip_norm=0.0,
                 muon_momentum=momentum, muon_nesterov=nesterov, muon_ns_steps=5, muon_rms=0.2)
    tx, _ = build_optimizer(optim, total, axes_of(params))
    theta = {k: jnp.asarray(v) for k, v in params.items()}
    state = tx.init(theta)
    ours = []
    for g in grads:
        updates, state = tx.update({k: jnp.asarray(v) for k, v in g.items()}, state, theta)
        theta = optax.apply_updates(theta, updates)
        ours.append({k: np.asarray(v, np.float64) for k, v in updates.items()})

    want = []
    theta64 = {k: v.astype(np.float64) for k, v in params.items()}
    buf = {k: np.zeros(s) for k, s in MUON_SHAPES.items()}
    for t, g in enumerate(grads):
        lr = _lr_float64(t, peak, end, warmup, total)
        step = {}
        for k, shape in MUON_SHAPES.items():
            gk = g[k].astype(np.float64)
            buf[k] = momentum * buf[k] + (1 - momentum) * gk
            direction = momentum * buf[k] + (1 - momentum) * gk if nesterov else buf[k]
            lead = MUON_BATCH[k]
            mats = direction.reshape(*shape[:lead], shape[lead], -1)  # [*batch, fan_in, fan_out]
            fan_in, fan_out = mats.shape[-2:]
            ortho = np.stack([_ns5_float64(m) for m in mats.reshape(-1, fan_in, fan_out)]).reshape(shape)
            step[k] = -lr * (ortho * 0.2 * np.sqrt(max(fan_in, fan_out)) + wd * theta64[k])
            theta64[k] = theta64[k] + step[k]
        want.append(step)
    return ours, want, params, grads


def test_muon_nesterov_steps_with_weight_decay_match_the_algorithm_in_float64():
    """Five `build_optimizer` steps on two Muon matrices (decayed, stacked, one per expert): momentum
    m = μm + (1−μ)g, Nesterov direction μm + (1−μ)g, quintic Newton–Schulz, RMS scale
    0.2·sqrt(max(fan_in, fan_out)), decoupled decay lr·wd·θ, under warmup then cosine (step 0: lr 0)."""
    ours, want, _, _ = _muon_run(True, **MUON_RUN)
    for t, (got, ref) in enumerate(zip(ours, want)):
        for k in MUON_SHAPES:
            scale = np.abs(ref[k]).max()
            # fp32 against float64 through five Newton–Schulz iterations: ~1e-6 of the update's size.
            np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=2e-5 * max(scale, 1e-30),
                                       err_msg=f"step {t}, {k}")
    assert all(np.abs(ours[0][k]).max() == 0 for k in MUON_SHAPES)  # warmup starts at lr 0


def test_muon_nesterov_steps_track_torch_optim_muon():
    """A second, outside reading of the same five steps: `torch.optim.Muon` (nesterov, decoupled
    decay, the match_rms_adamw scale), one 2-D parameter per matrix. Torch runs Newton–Schulz in
    bf16, so this bounds only to bf16's precision; the float64 test above owns exactness."""
    torch = pytest.importorskip("torch")
    run = MUON_RUN
    ours, _, params, grads = _muon_run(True, **run)
    for k, shape in MUON_SHAPES.items():
        lead = MUON_BATCH[k]
        start = params[k].reshape(-1, shape[lead], int(np.prod(shape[lead + 1:])))
        mats = [torch.nn.Parameter(torch.tensor(m, dtype=torch.float32)) for m in start]
        opt = torch.optim.Muon(mats, lr=0.0, weight_decay=run["wd"], momentum=run["momentum"], nesterov=True,
                               adjust_lr_fn="match_rms_adamw")
        for t, g in enumerate(grads):
            opt.param_groups[0]["lr"] = _lr_float64(t, run["peak"], run["end"], run["warmup"], run["total"])
            for p, gm in zip(mats, g[k].reshape(start.shape)):
                p.grad = torch.tensor(gm)
            opt.step()
        moved_torch = np.stack([p.detach().numpy() for p in mats]).reshape(shape) - params[k]
        moved_ours = sum(u[k] for u in ours)
        rel = np.linalg.norm(moved_ours - moved_torch) / np.linalg.norm(moved_ours)
        # bf16 keeps 8 significant bits (relative error 2^-8 ≈ 0.4% per rounding); five Newton–Schulz
        # iterations of a few roundings each land within a few percent. Nesterov off is ~30% away.
        assert rel < 0.05, (k, rel)
