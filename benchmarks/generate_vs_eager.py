"""Decode speed of `zaya_jax.generate` against Hugging Face `generate` in eager PyTorch, side by side,
and the cache's bytes from the code against the compiled decode step's.

The model is `experiments/tiny_cpu.py`'s (what the README's default run trains), with the same
random weights on both sides (an HF `ZayaForCausalLM`, read into ours through `hf_mapping`). For
batch 1 and batch 8, prompts of `--prompt-len` random tokens each generate `--new-tokens` greedy
tokens (no stop token, so every row runs to the end); tokens/s counts the new tokens of the batch
over the whole call (prefill included, compiling excluded: each side runs once before the timed
rounds). Rounds alternate between the two sides; each row is the median. Both use the machine's
cores as they do by default (PyTorch's intra-op pool; XLA's CPU client).

The cache rows: the bytes `model/decode.py` says a cache of the run's slots holds (keys and values
per CCA layer: `decode.cache_bytes_per_token`; plus the look-back rows) against what XLA's
compiled decode step takes as its cache argument (its argument bytes less the weights' and the
token ids').

    python benchmarks/generate_vs_eager.py --out=benchmarks/generate_vs_eager.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CONFIG = os.path.join(ROOT, "experiments", "tiny_cpu.py")


def build_pair(cfg):
    """(HF model, our model) with the same random weights."""
    import torch
    from transformers import ZayaConfig, ZayaForCausalLM

    from zaya_jax.checkpoint import hf_mapping
    from zaya_jax.config import to_hf_dict
    from zaya_jax.model.state import build_model, expected_shapes

    torch.manual_seed(0)
    hf = ZayaForCausalLM(ZayaConfig(**{k: v for k, v in to_hf_dict(cfg).items()
                                       if k not in ("architectures", "model_type")})).eval()
    state = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    shapes, arrays = expected_shapes(cfg), {}
    for group in hf_mapping.grouped_rules(cfg).values():
        arrays.update(hf_mapping.convert_group_to_ours(group, state.__getitem__, shapes, "hf"))
    return hf, build_model(cfg, arrays)


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def speed_rows(cfg, hf, ours, batch: int, prompt_len: int, new: int, rounds: int) -> dict:
    import torch

    from zaya_jax.generation import generate

    prompts = np.random.default_rng(batch).integers(3, cfg.vocab_size, (batch, prompt_len))

    def run_ours():
        return generate(ours, prompts.tolist(), max_new_tokens=new)

    def run_hf():
        with torch.no_grad():
            return hf.generate(torch.from_numpy(prompts).long(), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, eos_token_id=None, pad_token_id=0)

    same = run_ours() == run_hf()[:, prompt_len:].tolist()  # also the warm-up (compiles ours)
    seconds = {"ours": [], "hf": []}
    for _ in range(rounds):
        seconds["ours"].append(timed(run_ours))
        seconds["hf"].append(timed(run_hf))
    tps = {k: batch * new / statistics.median(v) for k, v in seconds.items()}
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new, "zaya_tokens_per_s": tps["ours"],
            "hf_eager_tokens_per_s": tps["hf"], "ratio": tps["ours"] / tps["hf"], "same_greedy_tokens": same}


def cache_rows(cfg, ours, batch: int, slots: int) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from zaya_jax import generation
    from zaya_jax.model import cca, decode

    cache = decode.empty_cache(cfg, jnp.zeros(batch, jnp.int32), slots)
    graphdef, state = nnx.split(ours)
    ids = jnp.zeros((batch, 1), jnp.int32)
    compiled = generation._step.lower(graphdef, state, ids, cache).compile()
    weights = sum(x.nbytes for x in jax.tree.leaves(state))
    from_xla = compiled.memory_analysis().argument_size_in_bytes - weights - ids.nbytes
    layers = cfg.layer_kinds.count("C")
    itemsize = jnp.dtype(cfg.compute_dtype).itemsize
    from_code = (layers * slots * batch * decode.cache_bytes_per_token(cfg)
                 + layers * batch * cca.look_back(cfg) * cfg.hidden_size * itemsize
                 + cache.start.nbytes + cache.length.nbytes + cache.linear_state.nbytes)
    return {"batch": batch, "slots": slots, "bytes_per_token_per_layer": decode.cache_bytes_per_token(cfg),
            "cache_bytes_from_code": int(from_code), "cache_bytes_from_xla": int(from_xla)}


def markdown(record: dict, cfg, args) -> str:
    lines = ["# zaya_jax.generate against Hugging Face generate (eager PyTorch)", "",
             f"`python benchmarks/generate_vs_eager.py`: tiny_cpu's model ({cfg.num_hidden_layers} layers, hidden "
             f"{cfg.hidden_size}, vocab {cfg.vocab_size}), the same random weights on both sides; "
             f"{args.prompt_len}-token prompts, {args.new_tokens} greedy tokens, median of {args.rounds} alternating "
             f"rounds, prefill included, compiling excluded; {record['machine']['cpus']} cores; jax "
             f"{record['versions']['jax']}, torch {record['versions']['torch']}, transformers "
             f"{record['versions']['transformers']}.", "",
             "| batch | zaya-jax tokens/s | HF eager tokens/s | ratio | same greedy tokens |", "|---:|---:|---:|---:|---|"]
    lines += [f"| {r['batch']} | {r['zaya_tokens_per_s']:.1f} | {r['hf_eager_tokens_per_s']:.1f} | {r['ratio']:.2f} | "
              f"{r['same_greedy_tokens']} |" for r in record["speed"]]
    lines += ["", "Cache bytes: what `model/decode.py` says a cache of these slots holds, against the compiled decode "
              "step's cache argument (XLA's argument bytes less the weights and token ids).", "",
              "| batch | slots | bytes per token and CCA layer | from the code | from XLA |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['slots']} | {r['bytes_per_token_per_layer']} | {r['cache_bytes_from_code']:,} | "
              f"{r['cache_bytes_from_xla']:,} |" for r in record["cache"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "generate_vs_eager.json"))
    args = p.parse_args(argv)

    import jax
    import torch
    import transformers

    from zaya_jax.experiment import load_experiment

    cfg = load_experiment(CONFIG, []).model
    hf, ours = build_pair(cfg)
    speed = [speed_rows(cfg, hf, ours, b, args.prompt_len, args.new_tokens, args.rounds) for b in (1, 8)]
    cache = [cache_rows(cfg, ours, b, args.prompt_len + args.new_tokens) for b in (1, 8)]
    print(f"tiny_cpu's model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}; "
          f"{args.prompt_len}-token prompts, {args.new_tokens} greedy tokens; {os.cpu_count()} cores")
    print(f"{'batch':>5} {'zaya-jax tok/s':>15} {'HF eager tok/s':>15} {'ratio':>6}  same tokens")
    for r in speed:
        print(f"{r['batch']:>5} {r['zaya_tokens_per_s']:>15.1f} {r['hf_eager_tokens_per_s']:>15.1f} "
              f"{r['ratio']:>6.2f}  {r['same_greedy_tokens']}")
    print(f"{'batch':>5} {'slots':>6} {'cache bytes (code)':>19} {'(XLA argument)':>15}")
    for r in cache:
        print(f"{r['batch']:>5} {r['slots']:>6} {r['cache_bytes_from_code']:>19,} {r['cache_bytes_from_xla']:>15,}")
    record = {"speed": speed, "cache": cache, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "versions": {"jax": jax.__version__, "torch": torch.__version__,
                           "transformers": transformers.__version__}}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(markdown(record, cfg, args))
    print(f"wrote {args.out} and its .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
