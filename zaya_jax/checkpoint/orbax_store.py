"""Model checkpoints in Orbax: the only module that calls Orbax for model weights.

Schedule: an Orbax checkpoint directory whose PyTree is `{"model": <nested model state>}` (keys
are the model's attribute paths, `layers/3/attn/wq`...), with the model config stored as
custom metadata under `zaya_jax`. Writes go group by group through Orbax's partial save, so
the host holds one layer at a time, and become visible only when finalized: a killed
conversion leaves no directory at the target path.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil
from typing import Iterable, Mapping

import jax
import numpy as np

from zaya_jax.checkpoint import replica_writes
from zaya_jax.config import ModelConfig
from zaya_jax.errors import ZayaError, quoted
from zaya_jax.trees import flatten, nest

FORMAT_VERSION = 1
ROOT = "model"
_METADATA_FILE = "_CHECKPOINT_METADATA"
_STATE_DIR = "state"


def _ocp():
    import orbax.checkpoint as ocp
    from orbax.checkpoint.experimental import v1 as ocpv1

    return ocp, ocpv1


@contextlib.contextmanager
def _quiet_absl():
    """Reading the v1 layout's `state/` item with the v0 reader makes Orbax warn that the item
    has no step metadata of its own; that is expected, so hide it from users."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def save_groups(path: str, cfg: ModelConfig, groups: Iterable[Mapping[str, np.ndarray]]) -> None:
    """Write a checkpoint from an iterable of flat `{path: array}` groups, one group in memory at a time."""
    _, ocpv1 = _ocp()
    path = os.path.abspath(path)
    if os.path.exists(path):
        raise ZayaError(f"{path} already exists; choose a new --out directory or remove the old one")
    metadata = {"zaya_jax": {"format_version": FORMAT_VERSION, "model_config": cfg.to_dict()}}
    if jax.process_index() == 0:  # the others wait in Orbax's first barrier, so none has written yet
        _remove_partials(path)  # left by a killed earlier run; Orbax would otherwise append to it
    try:
        with replica_writes.v1_context():
            for group in groups:
                # jax.Arrays stay on the devices: every process writes the shards it holds.
                tree = {ROOT: nest({k: v if isinstance(v, jax.Array) else np.asarray(v) for k, v in group.items()})}
                ocpv1.partial.save(path, tree, custom_metadata=metadata)
            ocpv1.partial.finalize(path)
    except BaseException:
        _remove_partials(path)
        raise


def _remove_partials(path: str) -> None:
    for leftover in glob.glob(glob.escape(path) + ".partial_save*"):
        shutil.rmtree(leftover, ignore_errors=True)


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, _METADATA_FILE))


def read_config(path: str) -> ModelConfig:
    """The model config of a zaya-jax checkpoint, or a ZayaError saying what the directory is not."""
    if not os.path.isdir(path):
        raise ZayaError(f"{path} does not exist or is not a directory")
    meta_file = os.path.join(path, _METADATA_FILE)
    if not os.path.isfile(meta_file):
        raise ZayaError(f"{path} is not an Orbax checkpoint (no {_METADATA_FILE}); was the save interrupted?")
    try:
        with open(meta_file) as f:
            meta = json.load(f)["custom_metadata"]["zaya_jax"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ZayaError(f"{path} is an Orbax checkpoint but not one written by zaya-jax (no model config)") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise ZayaError(f"{path} has checkpoint format {meta.get('format_version')}, this zaya-jax reads {FORMAT_VERSION}")
    try:
        return ModelConfig(**meta["model_config"])
    except (TypeError, ZayaError) as e:
        raise ZayaError(f"{path}: stored model config is invalid ({e})") from None


def stored_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Paths and shapes of every stored model tensor, from Orbax metadata (no data read)."""
    ocp, _ = _ocp()
    try:
        with _quiet_absl():
            meta = ocp.PyTreeCheckpointer().metadata(os.path.join(path, _STATE_DIR))
        item = meta.item_metadata if hasattr(meta, "item_metadata") else meta
    except Exception as e:  # Orbax raises many types for a damaged directory
        raise ZayaError(f"{path}: cannot read checkpoint metadata ({type(e).__name__}: {quoted(e, first_line=True)}); "
                        "the checkpoint is damaged") from None
    if getattr(item, "tree", None) is None:  # Orbax logs why and returns nothing
        raise ZayaError(f"{path}: the checkpoint's tensor metadata does not read (a file under {_STATE_DIR}/ is "
                        "truncated or missing); the checkpoint is damaged, write it again from its run")
    tree = item.tree
    return {k: tuple(v.shape) for k, v in flatten(tree.get(ROOT, {})).items()}


def load_arrays(path: str, keys: Iterable[str], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Read only `keys` (flat model paths) as host numpy arrays."""
    ocp, _ = _ocp()
    keys = list(keys)
    item = {ROOT: nest({k: jax.ShapeDtypeStruct(shapes[k], np.float32) for k in keys})}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    try:
        with _quiet_absl():
            out = ocp.PyTreeCheckpointer().restore(
                os.path.join(path, _STATE_DIR),
                args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True),
            )
    except Exception as e:
        raise ZayaError(f"{path}: cannot read tensors {keys[0]!r}...: {type(e).__name__}: {quoted(e, first_line=True)}; "
                        "the checkpoint is damaged") from None
    return flatten(out[ROOT])
