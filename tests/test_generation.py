"""Cached generation (`zaya_jax.generate`, `model/decode.py`): greedy tokens equal Hugging Face's
`generate` on the same weights; the cached step's logits equal the uncached forward's; a batch of
prompts of different lengths generates what each prompt does alone; sampling is reproducible from
its seed; the decode step compiles once; bad arguments are one-line errors."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zaya_jax import generate, generation
from zaya_jax.config import preset
from zaya_jax.errors import ZayaError
from zaya_jax.model import cca, decode
from zaya_jax.model.state import build_model
from zaya_jax.model.zaya import Zaya

PROMPTS = [[5, 17, 3, 99, 42, 7, 8], [11, 2]]  # longer and shorter than every config's look-back (3 and 4)
CONFIGS = {  # the parity tests' shapes: g = 2 with a 3-tap depthwise conv; g = 4 with a 4-tap grouped one
    "g2": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=3, cca_time0=3, cca_time1=2,
               num_hidden_layers=3, moe_intermediate_size=48),
    "g4": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_experts=8, cca_time0=2, cca_time1=4,
               partial_rotary_factor=1.0),
}


def _context_driven(hf):
    """A random model's residual stream is mostly the current token's embedding, so greedy decoding
    repeats it; weighting the layers' outputs over the stream makes the next token depend on the
    context (the tokens then vary, and a wrong cache shows)."""
    import torch

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "layers." in name and name.endswith(".residual_scale"):
                p.mul_(0.1)
            if "layers." in name and name.endswith(".hidden_states_scale"):
                p.mul_(3.0)
    return hf


def _random(cfg, seed):
    return Zaya(cfg, rngs=nnx.Rngs(seed))


def _pair(name):
    pytest.importorskip("torch")
    from hf_reference import hf_model, hf_to_ours, hf_state

    cfg = preset("tiny", **CONFIGS[name])
    hf = _context_driven(hf_model(cfg, 0))
    state = hf_state(hf)
    return cfg, hf, build_model(cfg, hf_to_ours(cfg, state.__getitem__))


def _stepwise_logits(model, full, prompt_len: int):
    """Logits of positions prompt_len-1 .. S-2 of `full` [1, S] through the cached step (the prompt
    at once, then one token at a time), compiled as `generate` compiles it; and the last cache."""
    graphdef, state = nnx.split(model)
    cache = decode.empty_cache(model.cfg, jnp.zeros(1, jnp.int32), full.shape[1])
    logits, cache = generation._step(graphdef, state, full[:, :prompt_len], cache)
    got = [np.asarray(logits[0])]
    for t in range(prompt_len, full.shape[1] - 1):
        logits, cache = generation._step(graphdef, state, full[:, t:t + 1], cache)
        got.append(np.asarray(logits[0]))
    return np.stack(got), cache


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    return _pair(request.param)


def test_greedy_tokens_equal_hugging_faces_generate(pair):
    import torch

    cfg, hf, model = pair
    ours = generate(model, PROMPTS, max_new_tokens=32)
    for prompt, tokens in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert tokens == ref[0, len(prompt):].tolist()
        assert len(set(tokens)) >= 4  # the context decides the next token, not a copy of the last one


def test_cached_logits_equal_the_uncached_forward(pair):
    cfg, _, model = pair
    prompt = PROMPTS[1]
    tokens = generate(model, [prompt], max_new_tokens=12)[0]
    full = jnp.asarray([prompt + tokens])
    want = np.asarray(model(full))[0]
    got, _ = _stepwise_logits(model, full, len(prompt))
    np.testing.assert_allclose(got, want[len(prompt) - 1:-1], atol=2e-5 * np.abs(want).max())
    assert len(prompt) < cca.look_back(cfg) < full.shape[1]  # the look-back fills from generated tokens


def test_a_batch_of_different_lengths_generates_what_each_prompt_does_alone(pair):
    _, _, model = pair
    together = generate(model, PROMPTS + [[3]], max_new_tokens=10)
    assert together == [generate(model, [p], max_new_tokens=10)[0] for p in PROMPTS + [[3]]]


def test_sampling_is_reproducible_from_its_seed_and_its_cuts_work(pair):
    _, _, model = pair
    draw = dict(max_new_tokens=16, temperature=1.5)
    one, again, other = (generate(model, PROMPTS, seed=s, **draw) for s in (1, 1, 2))
    assert one == again and one != other
    greedy = generate(model, PROMPTS, max_new_tokens=16)
    assert generate(model, PROMPTS, top_k=1, seed=3, **draw) == greedy  # only the most likely is left
    assert generate(model, PROMPTS, top_p=1e-6, seed=3, **draw) == greedy
    assert generate(model, PROMPTS, top_k=2, seed=3, **draw) != greedy


def test_a_row_stops_after_its_stop_token():
    cfg = preset("tiny", **CONFIGS["g2"])
    model = _random(cfg, 0)
    free = generate(model, PROMPTS, max_new_tokens=12)
    stop = free[0][3]
    stopped = generate(model, PROMPTS, max_new_tokens=12, stop=[stop])
    assert stopped[0] == free[0][:free[0].index(stop) + 1]
    assert stopped[1] == (free[1][:free[1].index(stop) + 1] if stop in free[1] else free[1])


def test_the_decode_step_compiles_once_for_every_token(compiles):
    model = _random(preset("tiny", **CONFIGS["g4"]), 0)
    generate(model, [[1, 2, 3]], max_new_tokens=3)  # compiled for this batch shape and cache size
    with compiles as seen:
        generate(model, [[4, 5, 6]], max_new_tokens=3)
    assert [n for n in seen.names if "_step" in n] == []
    with compiles as seen:
        generate(model, [[4, 5, 6, 7]], max_new_tokens=20)  # new shapes: one prefill, one decode step
    assert len([n for n in seen.names if "_step" in n]) == 2, seen.names


@pytest.mark.parametrize("kwargs, words", [
    (dict(prompts=[[1], []]), "prompt 1 is empty"),
    (dict(prompts=[]), "non-empty list"),
    (dict(prompts=[[1, 9999]]), "token id 9999 is outside the model's vocabulary of 256"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=1.0, top_k=0), "top_k must be an integer in 1..256"),
    (dict(temperature=1.0, top_p=1.5), "top_p must be in (0, 1]"),
    (dict(top_k=5), "set temperature > 0"),
])
def test_bad_arguments_are_one_line_errors(kwargs, words):
    model = _random(preset("tiny", **CONFIGS["g4"]), 0)
    args = dict(prompts=[[1, 2]], max_new_tokens=4) | kwargs
    with pytest.raises(ZayaError) as e:
        generate(model, args.pop("prompts"), **args)
    assert words in str(e.value) and "\n" not in str(e.value)


HYBRIDS = {  # no Hugging Face counterpart: the cached step against our uncached forward
    "retention": CONFIGS["g2"] | dict(layer_pattern="LC", linear_decay="retention", num_hidden_layers=4),
    "no-decay": CONFIGS["g4"] | dict(layer_pattern="LLC", linear_decay="none", linear_feature_map="silu",
                                     num_hidden_layers=3),
}


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_a_hybrid_models_cached_logits_equal_its_uncached_forward(name):
    cfg = preset("tiny", **HYBRIDS[name])
    model = _random(cfg, 1)
    prompts = [[5, 17, 3, 99, 42, 7, 8, 1, 2, 3], [11, 2]]
    together = generate(model, prompts, max_new_tokens=8)
    for prompt, tokens in zip(prompts, together):
        full = jnp.asarray([prompt + tokens])
        want = np.asarray(model(full))[0, len(prompt) - 1:-1]
        got, cache = _stepwise_logits(model, full, len(prompt))
        np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max())
        assert tokens == generate(model, [prompt], max_new_tokens=8)[0]
    assert cache.linear_state.shape[0] == cfg.layer_kinds.count("L") > 0
