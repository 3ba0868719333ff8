"""Per-device memory of one long-context model's train step under TP, SP, TP+SP and TSP on 8 devices.

Each layout's real train step (Muon/AdamW, full remat, fp32 compute, chunked loss) is compiled
from abstract shapes — nothing is allocated — and XLA's memory analysis gives the per-device
argument bytes (parameters, optimizer state, batch) and temporary bytes (activations, gathered
weights and K/V, gradients). The model is ZAYA1-shaped (CCA, top-1 MoE with skip, router) but
with 8 KV heads so that tensor parallelism can reach 8 devices (ZAYA1 itself has 2 KV heads,
which caps Megatron TP at 2 — TSP has no such cap). The TSP paper reports, for a 7B dense model
at 128K on 8 MI300X, 38.8 GB per GPU with TSP against 70.0 GB with TP.

    python tools/layout_memory.py --seq-len 8192 --out benchmarks/layout_memory_8k    # the table in docs/layouts.md
    python tools/layout_memory.py --seq-len 16384 --layouts tp,tsp --out /tmp/mem

fp32, as the table in docs/layouts.md was measured; relative sizes are what the study compares. Megatron
TP here shards heads and expert widths only (the embedding, norms and router stay whole on each
device, as in our rules).
Attention here is the `xla` backend, which materialises each device's [heads, queries, keys]
logits (on CPU the Pallas kernel runs in interpret mode, whose buffers say nothing about a GPU):
those temporaries are part of what is compared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

LAYOUTS = {  # name -> mesh axes (the rest 1)
    "tp": {"tensor": 8},
    "sp": {"sequence": 8},
    "tp2_sp4": {"tensor": 2, "sequence": 4},
    "tp4_sp2": {"tensor": 4, "sequence": 2},
    "tsp": {"tsp": 8},
}
STUDY_MODEL = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_experts=16,
                   moe_intermediate_size=1024, router_hidden_size=256, vocab_size=32768, compute_dtype="float32",
                   attention_kernel="xla", moe_kernel="xla", norm_kernel="xla")
BASE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "tiny_cpu.py")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=32768, help="tokens per sequence (default 32768)")
    parser.add_argument("--layers", type=int, default=4, help="CCA + MoE blocks (default 4)")
    parser.add_argument("--hidden", type=int, default=STUDY_MODEL["hidden_size"],
                        help=f"hidden size (default {STUDY_MODEL['hidden_size']}); the heads keep head_dim 128")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--out", default="benchmarks/layout_memory", help="writes OUT.json and OUT.md")
    return parser.parse_args(argv)


def overrides(seq_len: int, layers: int, hidden: int, mesh: dict) -> list[str]:
    values = {f"model.{k}": v for k, v in dict(STUDY_MODEL, hidden_size=hidden).items()}
    values.update({"model.num_hidden_layers": layers, "model.max_position_embeddings": seq_len,
                   "train.seq_len": seq_len, "train.global_batch_size": 1, "train.remat": "full",
                   "train.loss_vocab_chunk": 8192, "mesh.data": 1})
    values.update({f"mesh.{axis}": size for axis, size in mesh.items()})
    return [f"--config.{k}={v}" for k, v in values.items()]


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not names:
        print(f"layout_memory: error: unknown layout {unknown[0] if unknown else '(none)'}; choose from "
              f"{', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    if args.seq_len < 64 or args.layers < 1 or args.hidden < 64 or args.hidden % 64:
        print("layout_memory: error: --seq-len must be >= 64, --layers >= 1 and --hidden a multiple of 64",
              file=sys.stderr)
        return 2
    os.environ["JAX_PLATFORMS"] = "cpu"
    from zaya_jax.cpu_host import with_device_count

    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), 8)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from compile_step import compile_report

    from zaya_jax.errors import ZayaError
    from zaya_jax.experiment import load_experiment
    from zaya_jax.train.program import build_program

    rows = []
    for name in names:
        try:
            program = build_program(load_experiment(BASE, overrides(args.seq_len, args.layers, args.hidden, LAYOUTS[name])))
        except ZayaError as e:
            print(f"layout_memory: error: {name}: {e}", file=sys.stderr)
            return 2
        report = compile_report(program)
        rows.append({"layout": name, "mesh": LAYOUTS[name], "compile_sec": report["compile_sec"],
                     **report["per_device_bytes"]})
        print(f"compiled {name} in {report['compile_sec']}s", flush=True)
    model = dict(STUDY_MODEL, hidden_size=args.hidden)
    result = {"seq_len": args.seq_len, "layers": args.layers, "model": model, "devices": 8, "rows": rows}
    table = format_table(result)
    print(table)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    with open(args.out + ".md", "w") as f:
        f.write(table + "\n")
    print(f"wrote {args.out}.json and {args.out}.md")
    return 0


def format_table(result: dict) -> str:
    gib = 1024 ** 3
    rows = result["rows"]
    base = next((r["total"] for r in rows if r["layout"] == "tp"), rows[0]["total"])
    base_name = "tp" if any(r["layout"] == "tp" for r in rows) else rows[0]["layout"]
    m = result["model"]
    lines = [f"Per-device memory of the train step, {result['layers']} layers, hidden {m['hidden_size']}, "
             f"{m['num_attention_heads']} heads / {m['num_key_value_heads']} KV, {m['num_experts']} experts x "
             f"{m['moe_intermediate_size']}, vocab {m['vocab_size']}, {result['seq_len']} tokens x 1 sequence, "
             f"{m['compute_dtype']} compute, full remat, 8 devices (XLA memory_analysis of the compiled step, nothing allocated).",
             "",
             f"| layout | mesh | arguments GiB | temporaries GiB | total GiB | total / {base_name} |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
        lines.append(f"| {r['layout']} | {mesh} | {r['arguments'] / gib:.2f} | {r['temporaries'] / gib:.2f} | "
                     f"{r['total'] / gib:.2f} | {r['total'] / base:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
