"""Lowering for a GPU on a machine without one: the Pallas → Triton check that CPU tests can run.

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` runs Pallas's Triton lowering in
Python, so a kernel that Triton cannot express (an unsupported primitive, a bad block shape)
fails here, on CPU, with the error it would give on the GPU; each Triton module is also put
through Triton's verifier here (JAX hands it on unverified, and the GPU compiler would reject it:
the first H200 run found a loop whose bounds differed in type that way). The CPU interpreter,
which runs the same kernels in tests, accepts many such programs. This module owns:

- `lower(fn, args, platform)`: the StableHLO text of `fn` lowered for `cuda` or `rocm`, traced
  under that kernel target (so `auto` kernels, interpret mode and tuning rows are the GPU's);
- `triton_calls(text)`: how many Triton kernel calls the program makes at its call sites, by
  kernel name (a function called from two places counts twice, inlined or not);
- `kernel_cases` / `lower_kernel_case`: every Pallas kernel, forward and forward+backward, at
  ZAYA1's shapes (head_dim 128, 8 query : 2 KV heads, packed segment ids, the sequence-split
  offset form, 16 experts of 2048 x 2048; linear attention with decay and an entering state),
  from shapes alone (nothing is allocated).

`tools/lower_for_gpu.py` is the command; `Program.lower_train_step` lowers a whole train step.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import re
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from zaya_jax import jax_compat
from zaya_jax.errors import ZayaError, quoted
from zaya_jax.kernels import ops
from zaya_jax.kernels.registry import GPU_TARGETS, targeting

# The custom-call targets a Pallas Triton kernel lowers to: jaxlib 0.10 and 0.12 hand XLA the
# Triton IR (`__gpu$xla.gpu.triton`); 0.11 compiles it while lowering (`triton_kernel_call_ffi`).
_LAUNCH = re.compile(r'name = "([^"]*)", num_stages = (\d+) : i32, num_warps = (\d+) : i32')
_TRITON_CALL = re.compile(r'custom_call @(?:"?__gpu\$xla\.gpu\.triton"?|triton_kernel_call_ffi)\(.*?name = "([^"]*)"')
_FUNCTION = re.compile(r'^\s*func\.func (?:public |private )?@"?([^"(\s]+)"?\(', re.M)
_FUNCTION_CALL = re.compile(r'\bcall @"?([^"(\s]+)"?\(')  # `custom_call @` has no word boundary: not matched

# The GPU each platform's lowering is for, when no GPU is here: the device kind JAX's Triton
# lowering reads its architecture from (ZAYA1's MI300X is gfx942).
LOWERING_DEVICE_KIND = {"cuda": "NVIDIA H100", "rocm": "gfx942"}


def lowering_device(platform: str) -> jax.sharding.AbstractDevice:
    """The abstract GPU a lowering for `platform` targets (newer JAX asks the mesh for it)."""
    return jax.sharding.AbstractDevice(device_kind=LOWERING_DEVICE_KIND[check_platform(platform)],
                                       num_cores=None, platform="gpu")


@functools.cache
def can_lower(platform: str) -> tuple[bool, str]:
    """(True, "") when this installation can lower Pallas kernels for `platform`, else (False, why).

    Tried, not looked up by version: a one-block kernel is lowered. jaxlib 0.10 and 0.12 hand XLA
    the Triton IR, so any machine can; 0.11 compiles it while lowering, through the platform's
    plugin, which needs a GPU of that platform here.
    """
    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def kernel(x):
        return pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              compiler_params=pltriton.CompilerParams())(x)

    try:
        lower(kernel, (jax.ShapeDtypeStruct((16,), jnp.float32),), platform)
    except Exception as e:  # whatever this JAX raises where it cannot lower without the GPU
        why = quoted(e, first_line=True)
        return False, (f"jax {jax.__version__} cannot lower Pallas kernels for {platform} on this machine "
                       f"({why}); it needs a {platform} GPU here, or jax 0.10 or 0.12")
    return True, ""


def check_platform(platform: str) -> str:
    if platform not in GPU_TARGETS:
        raise ZayaError(f"GPU lowering takes a platform in {GPU_TARGETS}, got {platform!r}")
    return platform


def lower(fn: Callable, args, platform: str) -> str:
    """StableHLO text of jit(fn)(*args) lowered for `platform` ('cuda' or 'rocm'), traced for that
    target and for its lowering device (`lowering_device`); each Triton module verified as Triton
    will verify it on the GPU (`jax_compat.verifying_triton_modules`)."""
    mesh = jax.sharding.get_abstract_mesh().update(abstract_device=lowering_device(platform))
    with targeting(platform), jax.sharding.use_abstract_mesh(mesh), checked_lowering(platform):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def checked_lowering(platform: str):
    """For a GPU platform, Triton's verifier on every Pallas kernel as it is lowered: a kernel Triton
    would reject is one line naming it here, not an IR dump from the GPU compiler (or, lowered on a
    machine without the GPU, nothing at all). Other platforms lower no Triton: no check."""
    return jax_compat.verifying_triton_modules() if platform in GPU_TARGETS else contextlib.nullcontext()


def triton_calls(text: str) -> collections.Counter:
    """Triton kernel calls in lowered text by kernel name, each function's counted once per call
    of it from `main`. jax 0.10 lowers a body traced once and run twice (a two-step unrolled loop)
    as one private function called twice, later jax inlines both copies: counted at the call
    sites, both say the same. (A loop's body is one call site, however many times it runs.)"""
    starts = [(m.group(1), m.start()) for m in _FUNCTION.finditer(text)]
    if not starts:
        return collections.Counter(_TRITON_CALL.findall(text))
    ends = [start for _, start in starts[1:]] + [len(text)]
    bodies = {name: text[start:end] for (name, start), end in zip(starts, ends)}

    @functools.cache
    def made_by(name: str) -> collections.Counter:
        body = bodies[name]
        calls = collections.Counter(_TRITON_CALL.findall(body))
        for callee in _FUNCTION_CALL.findall(body):
            calls.update(made_by(callee))
        return calls

    return made_by("main" if "main" in bodies else starts[0][0])


def launch_params(text: str) -> set[tuple[str, int, int]]:
    """(kernel name, num_stages, num_warps) of each Triton call whose launch parameters the text
    shows (where the lowering hands XLA the Triton IR; jax 0.11 folds them into a compiled kernel)."""
    return {(name, int(stages), int(warps)) for name, stages, warps in _LAUNCH.findall(text)}


# ---------------------------------------------------------------------------------------------
# Every Pallas kernel at ZAYA1 shapes


@dataclasses.dataclass(frozen=True)
class KernelCase:
    name: str
    fn: Callable  # takes the args below, returns an array or a tuple of gradients
    args: tuple  # jax.ShapeDtypeStruct each
    expected: dict  # kernel name → Triton calls that must appear


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _fwd_bwd(fn, argnums):
    """Loss and gradients of sum(fn(...)): forward and backward kernels both stay live."""
    def loss(*args):
        return jnp.sum(fn(*args).astype(jnp.float32))

    return jax.value_and_grad(loss, argnums)


def kernel_cases(dtype=jnp.bfloat16, seq: int = 4096) -> list[KernelCase]:
    """The Pallas kernels forward and forward+backward at ZAYA1 shapes with operands of `dtype`."""
    batch, heads, kv_heads, head_dim = 1, 8, 2, 128
    hidden, experts, width, tokens = 2048, 16, 2048, seq
    q, kv = _spec((batch, seq, heads, head_dim), dtype), _spec((batch, seq, kv_heads, head_dim), dtype)
    seg = _spec((batch, seq), jnp.int32)
    half = seq // 2
    q_half, seg_half = _spec((batch, half, heads, head_dim), dtype), _spec((batch, half), jnp.int32)

    def attention(q, k, v, segs):
        return ops.flash_attention(q, k, v, segment_ids=segs, backend="pallas")

    def attention_offset(q, k, v, segs, kv_segs):  # the second half of a sequence split in two
        return ops.flash_attention(q, k, v, segment_ids=segs, kv_segment_ids=kv_segs, q_offset=half,
                                   backend="pallas")

    lhs, rhs, sizes = _spec((tokens, hidden), dtype), _spec((experts, hidden, width), dtype), \
        _spec((experts,), jnp.int32)

    def gmm(lhs, rhs, sizes):
        return ops.grouped_matmul(lhs, rhs, sizes, preferred_element_type=jnp.float32, backend="pallas")

    x, w = _spec((tokens, hidden), dtype), _spec((hidden,), jnp.float32)

    def norm(x, w):
        return ops.rms_norm(x, w, eps=1e-5, backend="pallas")

    decay, owner = _spec((heads,), jnp.float32), _spec((batch,), jnp.int32)
    state = _spec((batch, kv_heads, heads // kv_heads, head_dim, head_dim), jnp.float32)

    def linear(q, k, v, segs, decay, state, owner):
        return ops.linear_attention(q, k, v, segs, log_decay=decay, initial_state=state, initial_segment=owner,
                                    backend="pallas")

    linear_args = (q, kv, kv, seg, decay, state, owner)
    attn_fwd = {"zaya_forward_kernel": 1}
    attn_all = {"zaya_forward_kernel": 1, "zaya_dq_kernel": 1, "zaya_dkv_kernel": 1}
    return [
        KernelCase("attention fwd", attention, (q, kv, kv, seg), attn_fwd),
        KernelCase("attention fwd+bwd", _fwd_bwd(attention, (0, 1, 2)), (q, kv, kv, seg), attn_all),
        KernelCase("attention offset fwd", attention_offset, (q_half, kv, kv, seg_half, seg), attn_fwd),
        KernelCase("attention offset fwd+bwd", _fwd_bwd(attention_offset, (0, 1, 2)),
                   (q_half, kv, kv, seg_half, seg), attn_all),
        KernelCase("grouped matmul fwd", gmm, (lhs, rhs, sizes), {"zaya_grouped_matmul": 1}),
        KernelCase("grouped matmul fwd+bwd", _fwd_bwd(gmm, (0, 1)), (lhs, rhs, sizes),
                   {"zaya_grouped_matmul": 2, "zaya_grouped_matmul_transposed": 1}),
        KernelCase("rms norm fwd", norm, (x, w), {"zaya_rms_norm_fwd": 1}),
        KernelCase("rms norm fwd+bwd", _fwd_bwd(norm, (0, 1)), (x, w),
                   {"zaya_rms_norm_fwd": 1, "zaya_rms_norm_bwd": 1}),
        KernelCase("linear attention fwd", linear, linear_args, {"zaya_linear_attention_fwd": 1}),
        KernelCase("linear attention fwd+bwd", _fwd_bwd(linear, (0, 1, 2, 5)), linear_args,
                   {"zaya_linear_attention_fwd": 1, "zaya_linear_attention_dq": 1, "zaya_linear_attention_dkv": 1}),
    ]


def lower_kernel_case(case: KernelCase, platform: str) -> collections.Counter:
    """Lower one case for `platform`; ZayaError naming the case unless exactly the expected calls appear."""
    try:
        text = lower(case.fn, case.args, platform)
    except ZayaError:
        raise
    except Exception as e:  # the Triton lowering's own error, named for the kernel that raised it
        raise ZayaError(f"{case.name} does not lower for {platform}: {type(e).__name__}: "
                        f"{quoted(e, first_line=True)}") from e
    calls = triton_calls(text)
    if dict(calls) != case.expected:
        raise ZayaError(f"{case.name} lowered for {platform} to Triton calls {dict(calls)}, expected {case.expected}")
    return calls
