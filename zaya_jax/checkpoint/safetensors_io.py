"""Streaming safetensors I/O: read one tensor at a time, write files header-first then tensor by tensor.

We parse the format ourselves (8-byte little-endian header length, JSON header, raw data) so
that reading never maps a whole file, bf16 works through `ml_dtypes`, and a truncated or
corrupt file is reported by name before any tensor is used.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import struct
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

from zaya_jax.errors import ZayaError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
CODES = {v: k for k, v in DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: str) -> dict[str, TensorInfo]:
    """Index one .safetensors file, checking every tensor lies inside the file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ZayaError(f"{path} is truncated ({size} bytes): not a safetensors file")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > min(_MAX_HEADER, size - 8):
                raise ZayaError(f"{path} is truncated or corrupt: header claims {header_len} bytes, file has {size}")
            header = json.loads(f.read(header_len))
    except OSError as e:
        raise ZayaError(f"cannot read {path}: {e.strerror}") from None
    except ValueError:
        raise ZayaError(f"{path} is corrupt: its safetensors header is not valid JSON") from None
    base = 8 + header_len
    out = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[spec["dtype"]]
            begin, end = spec["data_offsets"]
            shape = tuple(int(s) for s in spec["shape"])
        except (KeyError, TypeError, ValueError):
            raise ZayaError(f"{path} is corrupt: bad header entry for tensor {name!r}") from None
        if end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise ZayaError(f"{path} is corrupt: tensor {name!r} has {end - begin} bytes for shape {shape}")
        if base + end > size:
            raise ZayaError(
                f"{path} is truncated: tensor {name!r} ends at byte {base + end} but the file has {size} bytes; "
                "re-download or re-export it"
            )
        out[name] = TensorInfo(path, dtype, shape, base + begin, end - begin)
    return out


class SafetensorsReader:
    """All tensors of an HF directory (single file or sharded with an index), read lazily."""

    def __init__(self, directory: str):
        self.directory = directory
        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
        if not files:
            raise ZayaError(f"{directory} has no *.safetensors files; it is not a Hugging Face checkpoint")
        self.tensors: dict[str, TensorInfo] = {}
        for path in files:
            self.tensors.update(read_header(path))
        index = os.path.join(directory, INDEX_NAME)
        if os.path.isfile(index):
            self._check_index(index)

    def _check_index(self, index: str) -> None:
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise ZayaError(f"{index} is not a valid safetensors index (no weight_map)") from None
        for name, file in weight_map.items():
            if name not in self.tensors:
                raise ZayaError(f"{index} lists tensor {name!r} in {file}, but that file is missing or lacks it")

    def names(self) -> list[str]:
        return list(self.tensors)

    def read(self, name: str) -> np.ndarray:
        info = self.tensors.get(name)
        if info is None:
            raise ZayaError(f"{self.directory} is missing tensor {name!r}")
        with open(info.file, "rb") as f:
            f.seek(info.offset)
            data = np.fromfile(f, dtype=info.dtype, count=info.nbytes // info.dtype.itemsize)
        return data.reshape(info.shape)


def write_file(path: str, specs: list[tuple[str, np.dtype, tuple[int, ...]]],
               arrays: Iterable[np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write one file from `specs` (name, dtype, shape), pulling arrays one at a time, in order.

    The header is fixed before any data, so only one tensor is ever held. Written to a
    temporary name and renamed at the end: a crash never leaves a half file under `path`.
    """
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, dtype, shape in specs:
        nbytes = np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": CODES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for (name, dtype, shape), array in zip(specs, arrays, strict=True):
            array = np.ascontiguousarray(array, dtype=dtype)
            if array.shape != tuple(shape):
                raise ValueError(f"tensor {name} has shape {array.shape}, planned {shape}")
            f.write(memoryview(array.reshape(-1).view(np.uint8)))
    os.replace(tmp, path)


def plan_shards(specs: list[tuple[str, np.dtype, tuple[int, ...]]], max_bytes: int) -> list[list[int]]:
    """Split tensor indices, in order, into files of at most `max_bytes` (a tensor never splits)."""
    shards: list[list[int]] = [[]]
    used = 0
    for i, (_, dtype, shape) in enumerate(specs):
        nbytes = np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))
        if shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += nbytes
    return shards


def shard_name(i: int, n: int) -> str:
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def write_sharded(directory: str, specs: list[tuple[str, np.dtype, tuple[int, ...]]],
                  fetch: Callable[[str], np.ndarray], max_bytes: int) -> list[str]:
    """Write `specs` as HF-named shards (plus an index when there are several); one tensor at a time."""
    shards = plan_shards(specs, max_bytes)
    weight_map = {}
    for i, idx in enumerate(shards):
        file = shard_name(i, len(shards))
        file_specs = [specs[j] for j in idx]
        write_file(os.path.join(directory, file), file_specs, (fetch(name) for name, _, _ in file_specs))
        weight_map.update({name: file for name, _, _ in file_specs})
    if len(shards) > 1:
        total = sum(np.dtype(d).itemsize * int(np.prod(s, dtype=np.int64)) for _, d, s in specs)
        write_index(directory, weight_map, total)
    return sorted(set(weight_map.values()))


def write_index(directory: str, weight_map: dict[str, str], total_size: int) -> None:
    with open(os.path.join(directory, INDEX_NAME), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, f, indent=2)

