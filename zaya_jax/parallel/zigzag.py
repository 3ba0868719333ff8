"""Which global sequence chunks each device holds under the sequence-like axes (`tsp`, `sequence`).

With D devices on those axes a sequence is cut into chunks. Contiguous: D chunks, device p holds
chunk p. Zigzag (`mesh.zigzag`, on by default): 2D chunks, device p holds chunks p and 2D−1−p,
in that order, so its local rows are [chunk p ‖ chunk 2D−1−p]. Under a causal mask the device
holding the last contiguous chunk attends to D times the keys of the first; zigzag pairs an early
chunk with a late one and every device does the same work.

`chunks_of` is the one place that says which chunks a device holds; everything else (the batch
permutation the program applies once when it places a batch, the look-back halo routes, the
attention offsets, the explorer) derives from it. Code that needs contiguous chunks (LASP-2's
prefix over chunk states) asks `zigzagged(...)` and refuses, or walks `chunks_of`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


def zigzagged(enabled: bool, devices: int) -> bool:
    """Whether a layout is zigzagged: `mesh.zigzag` on and the sequence split over > 1 device."""
    return bool(enabled) and devices > 1


def chunks_per_device(zigzag: bool) -> int:
    return 2 if zigzag else 1


def chunks_of(device, devices: int, zigzag: bool) -> tuple:
    """The global chunk indices device `device` holds, in its local order (`device` may be traced)."""
    if zigzag:
        return device, 2 * devices - 1 - device
    return (device,)


def by_chunk(a, slots: int):
    """Local rows [B, slots·C, ...] → [slots·B, C, ...]: local chunk s is rows s·B … (s+1)·B − 1, so
    per-row math sees each chunk as its own row."""
    if slots == 1:
        return a
    b, length = a.shape[:2]
    a = a.reshape(b, slots, length // slots, *a.shape[2:])
    return jnp.moveaxis(a, 1, 0).reshape(slots * b, length // slots, *a.shape[3:])


def from_chunks(a, slots: int):
    """The inverse of `by_chunk`."""
    if slots == 1:
        return a
    b, size = a.shape[0] // slots, a.shape[1]
    return jnp.moveaxis(a.reshape(slots, b, size, *a.shape[2:]), 0, 1).reshape(b, slots * size, *a.shape[2:])


def chunk_order(devices: int, zigzag: bool) -> np.ndarray:
    """Global chunk index of each chunk of the placed sequence, devices in order (int [chunks])."""
    return np.array([c for d in range(devices) for c in chunks_of(d, devices, zigzag)], np.int32)


def column_order(seq_len: int, devices: int, zigzag: bool) -> np.ndarray:
    """placed[..., j] = sequence[..., order[j]]: the columns of a placed batch (int [seq_len])."""
    chunks = chunk_order(devices, zigzag)
    size = seq_len // len(chunks)
    return (chunks[:, None] * size + np.arange(size)).reshape(-1)


def place(x, devices: int, zigzag: bool, axis: int = -1):
    """x with its sequence `axis` in placed (device) order; numpy or jax arrays."""
    if not zigzag:
        return x
    return x.take(column_order(x.shape[axis], devices, zigzag), axis=axis)


def unplace(x, devices: int, zigzag: bool, axis: int = -1):
    """The inverse of `place`: a placed sequence `axis` back in sequence order."""
    if not zigzag:
        return x
    return x.take(np.argsort(column_order(x.shape[axis], devices, zigzag)), axis=axis)


@dataclasses.dataclass(frozen=True)
class Route:
    """How local chunk `slot` gets the rows before it: from local chunk `source_slot` of the
    devices in `pairs` ((source, destination) device pairs, a `ppermute`) or, for the devices in
    `local`, of itself. Devices in neither hold the sequence's first chunk: nothing lies before it."""

    slot: int
    source_slot: int
    pairs: tuple[tuple[int, int], ...]
    local: tuple[int, ...]


def previous_chunk_routes(devices: int, zigzag: bool) -> list[Route]:
    """The routes that hand every chunk the tail of the chunk before it (the look-back halo)."""
    holder = {c: (d, s) for d in range(devices) for s, c in enumerate(chunks_of(d, devices, zigzag))}
    routes: dict[tuple[int, int], tuple[list, list]] = {}
    for d in range(devices):
        for slot, chunk in enumerate(chunks_of(d, devices, zigzag)):
            if chunk == 0:
                continue
            source, source_slot = holder[chunk - 1]
            pairs, local = routes.setdefault((slot, source_slot), ([], []))
            (local.append(d) if source == d else pairs.append((source, d)))
    return [Route(slot, source_slot, tuple(pairs), tuple(local)) for (slot, source_slot), (pairs, local)
            in sorted(routes.items())]


def busiest_causal_share(devices: int, zigzagged: bool) -> float:
    """Causal attention work of the busiest device over the average device's (1.0: balanced).

    Chunk g of n equal chunks has queries seeing g + 1/2 chunks of keys on average."""
    work = [sum(c + 0.5 for c in chunks_of(d, devices, zigzagged)) for d in range(devices)]
    return max(work) * devices / sum(work)
