"""Meshes for tests: a layout named by the axes it uses, every other mesh axis of size 1."""

import math

import jax

from zaya_jax.parallel.axes import MESH_AXES
from zaya_jax.parallel.mesh import build_mesh


def mesh_sizes(**sizes: int) -> dict[str, int]:
    """{axis: size} over every mesh axis, 1 where `sizes` does not name it."""
    unknown = set(sizes) - set(MESH_AXES)
    assert not unknown, f"not mesh axes: {sorted(unknown)}"
    return {a: sizes.get(a, 1) for a in MESH_AXES}


def fake_mesh(**sizes: int) -> jax.sharding.Mesh:
    """The mesh of `sizes` over the first fake CPU devices, as many as it needs."""
    return build_mesh(mesh_sizes(**sizes), jax.devices()[:math.prod(sizes.values())])
