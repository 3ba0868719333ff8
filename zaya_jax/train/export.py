"""The trained model alone, written to `WORKDIR/model` at the end of a run (`zaya_jax.load` reads it,
`zaya convert to-hf` exports it): every process writes its shards, process 0 alone moves directories
and leaves the run's tokenizer beside the model (`TOKENIZER_FILES`: `zaya generate` reads it)."""

from __future__ import annotations

import os
import shutil

import jax

from zaya_jax import storage
from zaya_jax.data.tokenizer import copy_hf_files, resolve_spec
from zaya_jax.model import layer_stack
from zaya_jax.train import barriers
from zaya_jax.train.program import Program


def save_model(program: Program, state, path: str) -> None:
    """The model (params + balancing biases) as a zaya-jax checkpoint, one layer group at a time.

    Every process writes its own shards through Orbax (`jax.Array`s sliced on the devices), so
    arrays no single host can address are saved too; process 0 alone moves directories."""
    from zaya_jax.checkpoint import orbax_store

    arrays = {**state.params, **state.biases}
    kinds = program.modeldef.cfg.layer_kinds
    row = jax.jit(lambda value, i: value[i])  # one layer's row, left sharded where it lies

    def groups():  # the per-layer interchange form, one layer at a time
        yield {k: v for k, v in arrays.items() if not layer_stack.is_stacked(k)}
        for i in range(len(kinds)):
            yield layer_stack.layer_entries(arrays, i, kinds, row)

    tmp = path + ".saving"
    tokenizer = program.exp.config.data.tokenizer
    timeout = program.exp.config.distributed.initialization_timeout_s
    _on_process_zero(lambda: shutil.rmtree(tmp, ignore_errors=True), "model_clear", timeout)
    with storage.guard(f"writing the final model to {tmp}", tmp):  # the run's checkpoints stay; `zaya train` again exports it
        orbax_store.save_groups(tmp, program.modeldef.cfg, groups())
        _on_process_zero(lambda: (write_tokenizer(tokenizer, tmp), shutil.rmtree(path, ignore_errors=True),
                                  os.replace(tmp, path)), "model_done", timeout)


def write_tokenizer(spec: str, folder: str) -> None:
    """The run's tokenizer beside its model: a copy of its tokenizer.json (and the tokenizer_config.json
    beside it, which may name its end-of-text token), or the word `bytes`."""
    resolved = resolve_spec(spec)
    if resolved == "bytes":
        with open(os.path.join(folder, "tokenizer.txt"), "w") as f:
            f.write("bytes\n")
    else:
        copy_hf_files(resolved.parent, folder)
        shutil.copyfile(resolved, os.path.join(folder, "tokenizer.json"))


def _on_process_zero(action, name: str, timeout_s: int) -> None:
    """Run a filesystem action once, then let every process go on after it."""
    if jax.process_index() == 0:
        action()
    barriers.barrier(name, timeout_s)
