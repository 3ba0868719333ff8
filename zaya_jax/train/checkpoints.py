"""Durable runs: the whole train state and the data iterator in Orbax checkpoints.

`WORKDIR/checkpoints/<step>/` holds three items, written by one Orbax `CheckpointManager`:
* `state` — the `TrainState` (step, params, balancing biases, optimizer and balancer states),
  saved with each array's sharding and restored into an abstract target built for the *current*
  mesh, so a run saved on one layout or device count resumes on another;
* `data` — the data lanes' states (`data/lanes.py`), one JSON file per process
  (`process_I-of-N.json`, the lanes that process reads); restoring merges every file, so a run
  saved by N processes resumes on any other number with no document repeated or skipped;
* `meta` — JSON: the model config, every state leaf's shape, the seed and the data settings,
  checked before any array is read so a mismatch is a sentence, not a tensorstore error.
The train step has no randomness of its own (no dropout), so the RNG state of a run is its seed
(`meta`) plus the data iterator's position (`data`).

Saves are asynchronous by default: `save()` returns once the arrays are copied off the devices,
and the writing runs in a background thread. Orbax writes into a temporary directory and renames
it when complete, so a save cut short by a kill is never taken as the newest checkpoint; such
leftovers are removed when the next run opens the directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from zaya_jax import storage
from zaya_jax.checkpoint import replica_writes
from zaya_jax.checkpoint.background_noise import quiet_background_failures
from zaya_jax.config import COMPUTE_FIELDS, ModelConfig
from zaya_jax.data.lanes import LaneRows, merge_states
from zaya_jax.data.pipeline import DataSettings
from zaya_jax.errors import StorageError, ZayaError, quoted

_META_VERSION = 2  # 2: block weights stacked on a leading layer axis (the scanned layers)


@dataclasses.dataclass
class SaveTiming:
    step: int
    blocking_sec: float  # the training loop waited this long
    background_sec: float | None = None  # started → written and committed


class RunCheckpoints:
    """The checkpoints of one run directory."""

    def __init__(self, directory: str, keep: int, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        quiet_background_failures()
        self._lock = threading.Lock()
        self._in_flight: SaveTiming | None = None
        self._storage_failed = False  # a save failed for want of space or permission, and said so
        self._finished: list[SaveTiming] = []
        self._started_at = 0.0
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, cleanup_tmp_directories=True,
            enable_async_checkpointing=async_save,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._on_written) if async_save else None)
        state = ocp.PyTreeCheckpointHandler(type_handler_registry=replica_writes.type_handler_registry())
        handlers = {"state": state, "data": DataStateHandler(), "meta": ocp.JsonCheckpointHandler()}
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        except (OSError, ValueError) as e:
            raise ZayaError(f"cannot open the checkpoint directory {self.directory} ({quoted(e, first_line=True)}); "
                            "check its permissions or choose another --workdir") from None
        self.async_save = async_save

    # ---- saving -----------------------------------------------------------------------------
    def save(self, step: int, state, iterator: LaneRows, meta: dict) -> float:
        """Start saving; returns how long the training loop was blocked (seconds)."""
        jax.block_until_ready(state)  # the step's own compute is not a checkpoint stall
        self.wait()  # one save in flight at a time: Orbax would wait here anyway
        started = time.perf_counter()
        with self._lock:
            self._in_flight, self._started_at = SaveTiming(step, 0.0), started
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                  data=DataStateSave(iterator.get_state()),
                                  meta=ocp.args.JsonSave({**meta, "step": int(step)}))
        with self._storage_errors(step):
            self._manager.save(step, args=args, force=True)
        blocking = time.perf_counter() - started
        with self._lock:
            self._in_flight.blocking_sec = blocking
            if not self.async_save:
                self._in_flight.background_sec = 0.0
                self._finished.append(self._in_flight)
                self._in_flight = None
        return blocking

    def _on_written(self) -> None:  # Orbax's background thread, after the save is complete
        with self._lock:
            if self._in_flight is not None:
                self._in_flight.background_sec = time.perf_counter() - self._started_at
                self._finished.append(self._in_flight)
                self._in_flight = None

    def finished_saves(self) -> list[SaveTiming]:
        """Saves completed since the last call (for metrics)."""
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def wait(self) -> None:
        with self._storage_errors(self._in_flight.step if self._in_flight else None):
            self._manager.wait_until_finished()

    @contextlib.contextmanager
    def _storage_errors(self, step: int | None):
        """A save that failed for want of space or permission, as one line (`storage.guard`): the
        step, the path, the free space, and which checkpoint is kept."""
        try:
            doing = (f"saving the checkpoint of step {step} to {self.directory}" if step is not None
                     else f"finishing the checkpoint writes in {self.directory}")  # no save of a known step
            with storage.guard(doing, self.directory, then=self._kept):
                yield
        except StorageError:
            self._in_flight = None  # that save is over
            self._storage_failed = True
            raise

    def _kept(self) -> str:
        previous = self._manager.latest_step()
        return f"the checkpoint of step {previous} is kept" if previous is not None else "no earlier checkpoint exists"

    def close(self) -> None:
        try:
            self.wait()
        except StorageError:
            pass  # said already by the save that failed; what is left is the cleanup below
        said = self._storage_failed
        try:
            with self._storage_errors(None):
                # Orbax starts a cleanup of stale temporary directories at construction and its
                # close() does not wait for it; a run that stops early (a bad config) would exit under it.
                cleanup = getattr(self._manager, "_cleanup_tmp_directory_future", None)
                if cleanup is not None:
                    cleanup.result()
                # Orbax waits for its writers again here, where a failed save can surface once more;
                # a run that has said it already says nothing more.
                self._manager.close()
        except StorageError:
            if not said:
                raise

    # ---- restoring --------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def read_meta(self, step: int) -> dict:
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 — any failure here means the checkpoint is unreadable
            raise _damaged(self.step_dir(step), e) from None
        return _checked_version(restored.meta, self.step_dir(step))

    def restore(self, step: int, abstract_state, iterator: LaneRows | None):
        """The state placed as `abstract_state` says; the iterator is restored in place if given."""
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
        args = {"state": ocp.args.PyTreeRestore(abstract_state, restore_args=restore_args)}
        if iterator is not None:
            args["data"] = DataStateRestore()
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        except Exception as e:  # noqa: BLE001 — tensorstore, OCDBT and JSON errors all mean "damaged"
            raise _damaged(self.step_dir(step), e) from None
        if iterator is not None:
            iterator.set_state(restored.data)
        return restored.state


class DataStateHandler:
    """Orbax handler of the `data` item: each process writes its lanes' states; a restore reads
    every process's file and merges them, whatever the process count was."""

    def save(self, directory, args: "DataStateSave") -> None:
        name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        (directory / name).write_text(json.dumps(args.state))

    def restore(self, directory, args: "DataStateRestore" = None) -> dict:
        files = sorted(glob.glob(os.path.join(os.fspath(directory), "process_*-of-*.json")))
        if not files:
            raise ValueError(f"no data state files in {directory}")
        states = []
        for path in files:
            with open(path) as f:
                states.append(json.load(f))
        return merge_states(states)

    def metadata(self, directory) -> None:
        return None

    def finalize(self, directory) -> None:
        pass

    def close(self) -> None:
        pass

    @classmethod
    def typestr(cls) -> str:
        return f"{cls.__module__}.{cls.__qualname__}"


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
    state: Any  # taken when the save starts: the iterator moves on while Orbax writes


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
    pass


def _checked_version(meta, where: str) -> dict:
    version = meta.get("version") if isinstance(meta, dict) else None
    if version == 1:
        raise ZayaError(f"checkpoint {where} was written by an older zaya-jax (one array per "
                        "layer, before the scanned layers); resume it with that version, or use a fresh --workdir")
    if version != _META_VERSION:
        raise ZayaError(f"checkpoint {where} has no zaya-jax metadata; it was not written by "
                        "`zaya train` (or by another version): use a fresh --workdir")
    return meta


def newest_meta(directory: str) -> tuple[int, str, dict] | None:
    """(step, its folder, its metadata) of the newest finished checkpoint under `directory`, read
    from the files alone: no Orbax manager, so no barrier between processes (each process reads
    it for itself, before the job's barriers are set up). None when there is none."""
    try:
        steps = [int(name) for name in os.listdir(directory) if name.isdigit()]  # Orbax renames a save when done
    except OSError:
        return None
    if not steps:
        return None
    step = max(steps)
    where = os.path.join(directory, str(step))
    try:
        with open(os.path.join(where, "meta", "metadata"), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise _damaged(where, e) from None
    return step, where, _checked_version(meta, where)


def run_meta(exp, abstract_state, process_count: int) -> dict:
    """What a checkpoint must agree on with the run that resumes it."""
    c = exp.config
    shapes = {jax.tree_util.keystr(path): list(leaf.shape)
              for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
    return {"version": _META_VERSION, "model": dataclasses.asdict(exp.model), "state_shapes": shapes,
            "seed": int(c.train.seed), "process_count": int(process_count), "data": data_fingerprint(c)}


def data_fingerprint(config) -> dict:
    """The settings that fix which rows the pipeline yields, in which order (not how fast)."""
    settings = dataclasses.asdict(DataSettings.from_config(config))
    del settings["read_threads"]
    return {**settings, "tokenizer": config.data.tokenizer}


def check_compatible(saved: dict, current: dict, where: str) -> None:
    """Raise if the checkpoint at `where` cannot be restored into the current run's state."""
    # A field the checkpoint does not record came later: the model that wrote it had the field's default.
    saved_model = {**dataclasses.asdict(ModelConfig()), **saved["model"]}
    model_diff = [k for k in current["model"] if saved_model.get(k) != current["model"][k]
                  and k not in COMPUTE_FIELDS]
    if model_diff:
        k = model_diff[0]
        raise ZayaError(f"checkpoint {where} holds a different model: model.{k} is {saved_model.get(k)!r} "
                        f"there but {current['model'][k]!r} in this config; use the checkpoint's config "
                        "or a fresh --workdir")
    missing = sorted(set(current["state_shapes"]) ^ set(saved["state_shapes"]))
    if missing and missing[0].startswith(".balance_state"):
        # Each balancer keeps its own state; the default changed from spread to solve once.
        raise ZayaError(f"checkpoint {where} was trained with another balancer ({missing[0]} is in one but not "
                        "the other); resume with the checkpoint's --config.optim.balancer (a run started before "
                        "solve became the default: --config.optim.balancer=spread) or use a fresh --workdir")
    if missing:
        raise ZayaError(f"checkpoint {where} holds a different train state ({missing[0]} is in one but not the "
                        "other; an optimizer setting changed?); use the checkpoint's config or a fresh --workdir")
    for path, shape in current["state_shapes"].items():
        if saved["state_shapes"].get(path) != shape:
            raise ZayaError(f"checkpoint {where} holds a different train state: {path} is "
                            f"{saved['state_shapes'].get(path)} there but {shape} here (an optimizer "
                            "setting changed?); use the checkpoint's config or a fresh --workdir")


def _damaged(where: str, error: Exception) -> ZayaError:
    return ZayaError(f"checkpoint {where} could not be read ({quoted(error, first_line=True)}); it is damaged or "
                     "incomplete: move it out of the checkpoints directory to resume from the one before it")
