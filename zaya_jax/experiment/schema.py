"""The experiment schema: every config key an experiment has, its type and its default.

`base_config(preset)` is where experiment files start: it returns an `ml_collections.ConfigDict`
holding every stable key (`train.*`, `eval.*`, `checkpoint.*`, `model.*`, `mesh.*`, `data.*`,
`optim.*`, `distributed.*`, `fault.*`) with a documented default. An experiment overrides values; it never adds keys, so
scripts and sweeps can rely on every name here. `model.*` uses Hugging Face `ZayaConfig` names.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from zaya_jax.config import preset as model_preset
from zaya_jax.model.remat import REMAT_POLICIES as _POLICIES

REMAT_POLICIES = tuple(_POLICIES)
BALANCERS = ("solve", "spread", "adam")  # optim.balancer: train/balancing.py
# Per balancer, optim.balance_lr where it is unset and the most it takes (experiment/validate.py).
# solve: half of each solved step (the experts' steps overlap: the tokens one expert sheds are the
# ones another draws); over 1 overshoots it. spread: benchmarks/routing_health.md. adam: the public
# guess for the report's rule (its lr is unpublished); Adam moves every bias by about its lr a step
# whatever the load, and at 1e-2 that herds a layer's tokens onto one expert within 5 steps.
BALANCE_LR = {"solve": (0.5, 1.0), "spread": (0.5, float("inf")), "adam": (1e-3, 3e-3)}
NS_DTYPES = ("auto", "float32", "bfloat16")  # optim.muon_ns_dtype (train/muon.py: ns_dtype)

# Keys whose value may legitimately be None, with the types allowed otherwise.
NULLABLE = {
    "model.pad_token_id": (int,),
    "model.bos_token_id": (int,),
    "model.eos_token_id": (int, list, tuple),
    "optim.balance_lr": (float, int),  # None: the balancer's own (BALANCE_LR)
}


def _train() -> dict:
    return dict(
        steps=1000,  # optimizer steps
        seed=0,  # parameter init and data order
        global_batch_size=8,  # sequences per optimizer step, summed over devices and micro-batches
        seq_len=256,  # tokens per sequence
        grad_accum_steps=1,  # micro-batches per step; each holds global_batch_size / grad_accum_steps rows
        log_every=10,  # a metrics.jsonl line every N steps (and at the last step)
        remat="none",  # per-block rematerialisation: none | full (save block inputs only) | dots | moe
        scan_layers=True,  # run the blocks as one scan (compile time flat in depth); False unrolls them (debugging)
        scan_unroll=1,  # blocks per scan iteration: XLA compiles this many copies (faster steps for shallow
        # models; on XLA CPU remat saves memory only at 1 block per iteration)
        loss_vocab_chunk=16384,  # vocabulary chunk of the cross-entropy; [tokens, chunk] logits at a time
        hardware="auto",  # peak-FLOPs profile for MFU: auto | mi300x | mi325x | mi355x | h100 | h200 | cpu
        progress=True,  # console progress bar
        compile_cache="workdir",  # persistent XLA compilation cache: workdir (WORKDIR/compile_cache, or $JAX_COMPILATION_CACHE_DIR when set) | off | a directory
        profile_steps="",  # START:STOP: a jax.profiler trace of steps START..STOP-1 in WORKDIR/profile ("" = off)
        cpu_devices=0,  # CPU runs: split the host into this many XLA devices (the mesh's data axis spans them;
        # each runs its share of the batch on its own core); 0 = JAX's one device. A device count in
        # XLA_FLAGS (--xla_force_host_platform_device_count) wins
    )


def _eval() -> dict:
    return dict(
        every_steps=0,  # held-out loss every N steps (0 = only at the end)
        batches=4,  # held-out batches per evaluation
        batch_size=0,  # sequences per held-out batch (0 = the training micro-batch); also the rows of a task batch
        # Downstream, at the same steps (train/downstream.py; needs the eval extra for tasks):
        tasks="",  # lm-eval tasks, comma-separated: names (hellaswag) or task YAML files ("" = none)
        task_limit=0,  # at most this many examples per task (0 = all)
        prompts=[],  # texts to continue greedily: WORKDIR/samples.jsonl and TensorBoard's text tab
        prompt_tokens=64,  # new tokens per prompt
    )


def _checkpoint() -> dict:
    return dict(
        every_steps=0,  # save the full train state every N steps (0 = only at the end and on SIGTERM/SIGINT)
        keep=2,  # how many step checkpoints to keep
        async_save=True,  # write in the background; the loop only waits for the device→host copy
        resume=True,  # continue from the newest complete checkpoint in WORKDIR/checkpoints
    )


def _optim() -> dict:
    return dict(
        lr=6e-4,  # peak learning rate (Muon and AdamW share it; Muon is RMS-matched to AdamW)
        min_lr=2e-4,  # end of the cosine
        warmup_steps=100,  # linear warmup from 0
        decay_steps=0,  # length of warmup + cosine (0 = train.steps)
        weight_decay=0.1,  # decoupled, on weight matrices, convs and the embedding only
        b1=0.9,
        b2=0.95,
        eps=1e-8,
        clip_norm=1.0,  # global gradient-norm clip (0 = off)
        # ZeRO-1: optimizer state split over the mesh's `data` axis, gradients reduce-scattered onto
        # it once per step (no effect without mesh.data > 1; docs/layouts.md)
        shard_over_data=True,
        muon_momentum=0.95,
        muon_nesterov=True,
        muon_ns_steps=5,  # Newton–Schulz iterations
        # the dtype of its products: auto = bfloat16 on GPUs (as torch.optim.Muon), float32 on CPU
        muon_ns_dtype="auto",
        muon_rms=0.2,  # update RMS Muon is scaled to (AdamW's typical update RMS)
        # ZAYA1's bias balancer (train/balancing.py): each step every bias moves against its expert's
        # overload. solve: the biases solved on the step's first micro-batch routed again by the updated
        # model, balance_lr the share of the solved step taken (one forward of a micro-batch a step; even
        # at every step where spread is not: benchmarks/routing_seeds.md);
        # spread: by balance_lr × the overload E·load − 1 × the spread of the router's probabilities
        # between tokens, plus the drift of its mean probability; adam: the report's Adam, by about
        # balance_lr whatever the error. balance_lr None: the balancer's own default; 0: off
        balancer="solve",
        balance_lr=None,
        balance_b1=0.9,  # adam only
        balance_b2=0.999,  # adam only
    )


def _data() -> dict:
    return dict(
        # One source or a comma-separated mixture: builtin:python-docs, .txt, .jsonl, .parquet,
        # .arrayrecord files, or directories of them.
        source="builtin:python-docs",
        weights="",  # mixture weights, comma-separated, one per source (share of training rows)
        text_field="text",  # JSONL field / Parquet column holding the document text
        tokenizer="bytes",  # "bytes" or a path to a Hugging Face tokenizer.json (or its directory)
        heldout_fraction=0.05,  # documents kept out of training for the held-out loss
        read_threads=4,  # threads reading and tokenizing documents: lanes (rows) advanced in parallel
    )


def _distributed() -> dict:
    # Multi-process runs only (`zaya launch`, SLURM, Kubernetes): JAX's distributed runtime.
    return dict(
        initialization_timeout_s=300,  # wait this long for the coordinator and for every process to join
        heartbeat_timeout_s=100,  # a process silent this long is declared dead and the job stops
    )


def _fault() -> dict:
    # Surviving faults (docs/faults.md); exit statuses in zaya_jax/exit_codes.py.
    return dict(
        hang_timeout_sec=1800,  # no step progress this long: dump every thread's stack, exit 3 (0 = off)
        io_timeout_sec=3600,  # the same for a checkpoint restore or save, the final model save (0 = off)
        spike_sigmas=6.0,  # a loss or grad norm this many std devs above the recent mean is a bad step (0 = off)
        spike_window=128,  # good steps the spike rule looks back over (and waits for)
        max_consecutive_bad_steps=8,  # this many bad steps in a row: act (fault.on_bad_steps); 0 = never
        on_bad_steps="rollback",  # rollback (to the newest checkpoint, past the bad data) | stop (exit 4)
        max_rollbacks=3,  # rollbacks in one attempt before it stops instead (exit 4)
        drill="",  # fault drill, first attempt only: e.g. "hang:process=1,step=5,sec=600; nan:step=3,steps=2"
    )


def _mesh() -> dict:
    # 1 = unused; one axis may be -1 to take all remaining devices.
    return dict(data=-1, fsdp=1, expert=1, tsp=1, tensor=1, sequence=1,
                # With tsp x sequence = D > 1: cut each sequence into 2D chunks, device p holding chunks
                # p and 2D-1-p, so causal attention costs every device the same (parallel/zigzag.py);
                # False: D contiguous chunks (the last device attends to D times the keys of the first)
                zigzag=True)


def base_config(preset: str = "tiny_cpu") -> ml_collections.ConfigDict:
    """Every experiment key with its default; `model.*` from the named model preset."""
    model = dataclasses.asdict(model_preset(preset))
    return ml_collections.ConfigDict(
        dict(train=_train(), eval=_eval(), checkpoint=_checkpoint(), optim=_optim(), data=_data(),
             mesh=_mesh(), distributed=_distributed(), fault=_fault(), model=model)
    )


def balance_lr(optim) -> float:
    """`optim.balance_lr`, or where it is None the balancer's own default."""
    return BALANCE_LR[optim.balancer][0] if optim.balance_lr is None else float(optim.balance_lr)
