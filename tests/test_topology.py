"""Node-major device order and the axes that cross nodes, from the processes' host names."""

import dataclasses

import pytest

from zaya_jax.errors import ZayaError
from zaya_jax.parallel.mesh import build_mesh
from zaya_jax.parallel.topology import Topology


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int


def _devices(processes: int, per_process: int) -> list[FakeDevice]:
    return [FakeDevice(p * 1000 + i, p) for p in range(processes) for i in range(per_process)]


def test_hosts_number_the_nodes_in_order_of_their_first_process():
    topology = Topology.from_hosts(["b", "a", "b", "a"])
    assert topology.node_of_process == (0, 1, 0, 1) and topology.nodes == 2 and topology.process_count == 4


def test_order_puts_each_nodes_devices_together_even_when_process_ids_interleave_nodes():
    topology = Topology.from_hosts(["n0", "n1", "n0", "n1"])  # one process per GPU, ranks dealt round-robin
    devices = _devices(4, 2)
    ordered = topology.order(list(reversed(devices)))
    assert [(topology.node_of(d), d.process_index) for d in ordered] == \
        [(0, 0), (0, 0), (0, 2), (0, 2), (1, 1), (1, 1), (1, 3), (1, 3)]
    assert topology.devices_per_node(devices) == 4


def test_uneven_nodes_are_refused_in_words():
    topology = Topology.from_hosts(["n0", "n0", "n1"])
    with pytest.raises(ZayaError, match="node 0: 4, node 1: 2"):
        topology.devices_per_node(_devices(3, 2))


def test_chatty_axes_stay_inside_a_node_and_data_spans_the_nodes():
    import jax

    devices = jax.devices()[:8]  # 8 fake CPU devices, pretended to be 2 nodes of 4
    topology = _NodesOf4()
    mesh = build_mesh({"data": 2, "fsdp": 1, "expert": 1, "tsp": 2, "tensor": 2, "sequence": 1},
                      topology.order(devices))
    assert topology.axes_across_nodes(mesh) == ["data"]
    mesh = build_mesh({"data": 1, "fsdp": 1, "expert": 8, "tsp": 1, "tensor": 1, "sequence": 1},
                      topology.order(devices))
    assert topology.axes_across_nodes(mesh) == ["expert"]


class _NodesOf4(Topology):
    def node_of(self, device) -> int:
        return device.id // 4
