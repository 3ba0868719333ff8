"""The model picks its kernels from the config; every backend gives the reference model's numbers."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from kernel_checks import assert_close
from zaya_jax import kernels
from zaya_jax.config import ModelConfig, preset, to_hf_dict
from zaya_jax.errors import ZayaError
from zaya_jax.kernels import registry
from zaya_jax.model import Zaya
from zaya_jax.train.checkpoints import check_compatible

IDS = jax.random.randint(jax.random.PRNGKey(1), (2, 40), 0, 256)
SEGMENTS = jnp.cumsum(jax.random.bernoulli(jax.random.PRNGKey(2), 0.1, (2, 40)), axis=1).astype(jnp.int32)


def _logits_and_grads(backend: str, compute_dtype: str = "float32"):
    cfg = preset("tiny", attention_kernel=backend, moe_kernel=backend, norm_kernel=backend,
                 compute_dtype=compute_dtype)
    graph, state = nnx.split(Zaya(cfg, rngs=nnx.Rngs(0)))

    def loss(state):
        logits = nnx.merge(graph, state)(IDS, segment_ids=SEGMENTS)
        targets = jnp.take_along_axis(logits, IDS[..., None], -1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - targets), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return logits, grads


@pytest.mark.parametrize("backend,compute_dtype", [("pallas", "float32"), ("xla", "float32"),
                                                   ("pallas", "bfloat16")])
def test_model_logits_and_gradients_match_reference_kernels(backend, compute_dtype):
    logits, grads = _logits_and_grads(backend, compute_dtype)
    ref_logits, ref_grads = _logits_and_grads("reference", compute_dtype)
    tol = jnp.float32 if compute_dtype == "float32" else jnp.bfloat16
    assert_close(logits, ref_logits, tol, f"{backend} model logits")
    flat, ref_flat = nnx.to_flat_state(grads), dict(nnx.to_flat_state(ref_grads))
    for path, value in flat:
        assert_close(value.get_value(), ref_flat[path].get_value(), tol, f"{backend} gradient of {path}")


def test_platform_defaults_and_interpret_mode_follow_the_machine():
    # Whatever JAX runs on (CPU in CI, a GPU under JAX_PLATFORMS=cuda or rocm): `auto` is XLA and
    # Pallas interprets on CPU; `auto` is Pallas, compiled, on a GPU.
    device = jax.devices()[0]
    on_gpu = device.platform not in ("cpu", "tpu")
    version = f"{device.client.platform_version}".lower()
    target = ("rocm" if "rocm" in version or "hip" in version else "cuda") if on_gpu else device.platform
    assert registry.target() == target
    assert registry.platform() == ("gpu" if on_gpu else target)
    assert registry.gpu_vendor() == (target if on_gpu else None)
    expected = dict.fromkeys(kernels.KERNELS, "pallas" if on_gpu else "xla")
    if target == "cpu":
        expected["grouped_matmul"] = "tiled"  # XLA's CPU ragged_dot multiplies every row by every group
    assert {k: kernels.resolve(k, None) for k in kernels.KERNELS} == expected == registry.DEFAULTS[target]
    assert kernels.resolve("attention", "auto") == expected["attention"]
    assert registry.interpret_mode(None) is (not on_gpu)
    assert registry.interpret_mode(False) is False and registry.interpret_mode(True) is True


def test_unknown_and_unavailable_backends_are_one_sentence_errors():
    with pytest.raises(ZayaError, match=r"must be one of \('auto', 'reference', 'xla', 'pallas'\)"):
        kernels.resolve("rms_norm", "cudnn")
    if registry.gpu_vendor() == "cuda":
        assert kernels.resolve("attention", "cudnn") == "cudnn"
    else:
        with pytest.raises(ZayaError, match="needs an NVIDIA GPU .*use 'pallas' or 'xla'"):
            kernels.flash_attention(jnp.ones((1, 4, 2, 16)), jnp.ones((1, 4, 2, 16)), jnp.ones((1, 4, 2, 16)),
                                    backend="cudnn")
    with pytest.raises(ZayaError, match="model.norm_kernel must be one of"):
        ModelConfig(norm_kernel="fused")


def test_kernel_choice_is_not_part_of_the_model():
    cfg = preset("tiny")
    pallas = cfg.replace(attention_kernel="pallas", moe_kernel="pallas", norm_kernel="pallas")
    hf = to_hf_dict(pallas)
    assert not {"attention_kernel", "moe_kernel", "norm_kernel"} & set(hf)
    meta = {"model": dataclasses.asdict(cfg), "state_shapes": {}}
    check_compatible(meta, {"model": dataclasses.asdict(pallas), "state_shapes": {}}, "ckpt/4")
