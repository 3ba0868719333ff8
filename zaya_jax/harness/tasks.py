"""lm-eval tasks by name or by YAML file, checked before any model is loaded or compiled.

A task is a name lm-eval knows (`hellaswag`, a glob like `arc_*`, a group) or a task YAML file;
`include_paths` are folders of further task YAMLs (lm-eval's `--include_path`). Every name must
match a task and every file must exist: a typo is one line naming it, not a failure after the
model has loaded. A task file's relative `data_files` are read beside it, so a task folder with
its JSONL works from any directory.
"""

from __future__ import annotations

import glob
import os
from typing import Sequence

from zaya_jax.errors import ZayaError


def resolve_tasks(tasks: Sequence[str], include_paths: Sequence[str] = ()):
    """(lm-eval's TaskManager, the task list `lm_eval.simple_evaluate` takes)."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    for folder in include_paths:
        if not os.path.isdir(folder):
            raise ZayaError(f"task folder {folder} does not exist; pass a folder of lm-eval task YAMLs")
    names = [t.strip() for entry in tasks for t in entry.split(",") if t.strip()]
    if not names:
        raise ZayaError("no task given: name lm-eval tasks (hellaswag,arc_easy) or task YAML files")
    manager = TaskManager(include_path=list(include_paths) or None)
    resolved, missing = [], []
    for name in names:
        if name.endswith((".yaml", ".yml")):
            files = sorted(glob.glob(os.path.expanduser(name)))
            if not files:
                raise ZayaError(f"task file {name} does not exist; pass an lm-eval task YAML")
            resolved += [_read_task(load_yaml, f) for f in files]
        else:
            matches = manager.match_tasks([name])
            resolved += [m for m in matches if m not in resolved]
            if not matches:
                missing.append(name)
    if missing:
        raise ZayaError(f"unknown lm-eval task(s): {', '.join(missing)}; `lm-eval ls tasks` lists them "
                        "(a local task needs its YAML path or its folder in --include-path)")
    return manager, resolved


def _read_task(load_yaml, path: str) -> dict:
    try:
        config = load_yaml(path, resolve_func=True)
    except Exception as e:  # YAML syntax, a missing !function module: lm-eval raises whatever it meets
        raise ZayaError(f"task file {path} could not be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                        "fix the YAML") from None
    if not isinstance(config, dict) or "task" not in config:
        raise ZayaError(f"task file {path} names no task (a `task:` key); write an lm-eval task YAML")
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if files is not None:
        config["dataset_kwargs"]["data_files"] = _beside(files, os.path.dirname(os.path.abspath(path)))
    return config


def _beside(files, folder: str):
    """Relative data files of a task YAML, as paths beside the YAML where such a file exists
    (lm-eval would look in the working directory)."""
    if isinstance(files, dict):
        return {split: _beside(f, folder) for split, f in files.items()}
    if isinstance(files, list):
        return [_beside(f, folder) for f in files]
    if isinstance(files, str) and not os.path.isabs(files) and os.path.exists(os.path.join(folder, files)):
        return os.path.join(folder, files)
    return files
