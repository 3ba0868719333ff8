"""Which node (host) each process runs on, and the node-major device order the mesh is laid on.

The start-up (`cluster/startup.py`) learns the hosts of all processes once, through the
distributed runtime's key-value store, and hands a `Topology` down; nothing here asks JAX for
global state. `order` puts one node's devices next to each other, so `parallel/mesh.build_mesh`
(`axes.PLACEMENT`, innermost axis fastest) keeps tensor, tsp and expert inside a node and spreads
data over the nodes, whether a node runs one process for all its GPUs or one process per GPU.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from zaya_jax.errors import ZayaError


@dataclasses.dataclass(frozen=True)
class Topology:
    """`node_of_process[p]` is the node (0, 1, ... in order of each node's first process) of process p."""

    node_of_process: tuple[int, ...] = (0,)

    @classmethod
    def from_hosts(cls, hosts: list[str]) -> "Topology":
        """From each process's host name (index = process id)."""
        rank: dict[str, int] = {}
        for host in hosts:
            rank.setdefault(host, len(rank))
        return cls(tuple(rank[h] for h in hosts))

    @classmethod
    def one_node(cls, processes: int) -> "Topology":
        """Every process on one machine: the view of a run that was not told otherwise."""
        return cls((0,) * processes)

    @property
    def nodes(self) -> int:
        return len(set(self.node_of_process))

    @property
    def process_count(self) -> int:
        return len(self.node_of_process)

    def node_of(self, device) -> int:
        return self.node_of_process[device.process_index]

    def order(self, devices) -> list:
        """Devices node by node; inside a node by process, then by device id."""
        return sorted(devices, key=lambda d: (self.node_of(d), d.process_index, d.id))

    def axes_across_nodes(self, mesh) -> list[str]:
        """The mesh axes (in mesh order) whose groups hold devices of more than one node."""
        nodes = np.vectorize(self.node_of, otypes=[int])(mesh.devices)
        out = []
        for i, axis in enumerate(mesh.axis_names):
            groups = np.moveaxis(nodes, i, -1).reshape(-1, nodes.shape[i])
            if any(len(set(group)) > 1 for group in groups):
                out.append(axis)
        return out

    def devices_per_node(self, devices) -> int:
        """The devices each node holds; every node must hold the same number (a mesh is a grid)."""
        counts = Counter(self.node_of(d) for d in devices)
        sizes = set(counts.values())
        if len(sizes) != 1:
            detail = ", ".join(f"node {n}: {c}" for n, c in sorted(counts.items()))
            raise ZayaError(f"the nodes hold different numbers of devices ({detail}); start the same number of "
                            "processes with the same number of devices on every node")
        return sizes.pop()
