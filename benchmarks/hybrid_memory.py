"""Per-device memory of the train step under `sequence=8` as the sequence grows: hybrid models against all-CCA.

XLA's memory analysis of the compiled step (nothing is allocated) on 8 fake CPU devices, for the
tiny model (`experiments/layouts/hybrid_sequence8.py`: 4 layers, hidden 128) at 8K, 16K and 32K
tokens, one sequence per step, for three layer patterns: all linear attention (`L`), the hybrid
(`LLLC`) and all CCA (`C`). A linear layer's LASP-2 exchanges d × d states, so its memory should
grow linearly with the sequence. A CCA layer's gathered K/V grow linearly too, but its attention
kernel decides the rest: the `xla` attention (the CPU default) keeps [S/8, S] fp32 probabilities
per head for its backward (quadratic), the `pallas` flash attention (the GPU default; compiled
here in interpret mode) keeps only its outputs and row statistics.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/hybrid_memory.py \\
        --out benchmarks/hybrid_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "experiments", "layouts",
                      "hybrid_sequence8.py")
VARIANTS = (("L", "xla"), ("LLLC", "xla"), ("LLLC", "pallas"), ("C", "xla"), ("C", "pallas"))  # (pattern, attention)
LENGTHS = (8192, 16384, 32768)
GIB = 2 ** 30


def measure(pattern: str, attention: str, length: int) -> dict:
    import jax

    from zaya_jax.explore.against_xla import memory_report
    from zaya_jax.experiment import load_experiment
    from zaya_jax.train.program import build_program

    overrides = [f"--config.model.layer_pattern={pattern}", f"--config.train.seq_len={length}",
                 f"--config.model.max_position_embeddings={length}", "--config.train.global_batch_size=1",
                 "--config.mesh.data=1", f"--config.model.attention_kernel={attention}"]
    program = build_program(load_experiment(CONFIG, overrides), jax.devices()[:8])
    report = memory_report(program)
    return {"pattern": pattern, "attention": attention, "seq_len": length, **{k: report[k] for k in ("argument_bytes", "temp_bytes")},
            "compile_s": report["compile_s"]}


def table(rows: list[dict]) -> str:
    lines = ["| pattern | CCA attention | tokens | arguments GiB | temporaries GiB | temporaries / 8K's |",
             "|---|---|---:|---:|---:|---:|"]
    base = {(r["pattern"], r["attention"]): r["temp_bytes"] for r in rows if r["seq_len"] == LENGTHS[0]}
    for r in rows:
        cca = "—" if "C" not in r["pattern"] else f"`{r['attention']}`"
        lines.append(f"| `{r['pattern']}` | {cca} | {r['seq_len']:,} | {r['argument_bytes'] / GIB:.3f} | "
                     f"{r['temp_bytes'] / GIB:.3f} | {r['temp_bytes'] / base[(r['pattern'], r['attention'])]:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the numbers as JSON here")
    args = parser.parse_args(argv)
    import jax

    if len(jax.devices()) < 8:
        print("hybrid_memory: error: needs 8 devices; run with XLA_FLAGS=--xla_force_host_platform_device_count=8",
              file=sys.stderr)
        return 2
    rows = []
    for pattern, attention in VARIANTS:
        for length in LENGTHS:
            rows.append(measure(pattern, attention, length))
            print(f"  {pattern:5s} {attention:7s} {length:6d}: temporaries {rows[-1]['temp_bytes'] / GIB:.3f} GiB "
                  f"(compiled in {rows[-1]['compile_s']} s)", file=sys.stderr, flush=True)
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
