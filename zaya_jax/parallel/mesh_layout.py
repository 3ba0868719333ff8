"""The model's `Layout` on a device mesh: attention, experts and kernels run by the layout schedules.

`MeshLayout` routes each layer to `attention_layout` (tsp, tensor or sequence split), to
`experts_layout` (any split axis: each device sorts only its own tokens) and to
`batch_map.run_kernel` (Pallas kernels shard_mapped over the batch and sequence axes). Each asks
the mesh it is traced under (`Program` traces under its own) which axes are split.
"""

from __future__ import annotations

from zaya_jax.model.layout import Layout
from zaya_jax.parallel import attention_layout, experts_layout
from zaya_jax.parallel.batch_map import run_kernel


class MeshLayout(Layout):
    def attention(self, params, x, seq, cfg):
        return attention_layout.cca(params, x, seq, cfg) if attention_layout.active() else None

    def experts(self, x, routing, gate, up, down, backend):
        if not experts_layout.active(backend):
            return None
        return experts_layout.experts(x, routing.expert, routing.weight, gate, up, down, backend=backend)

    def run_kernel(self, kernel, backend, fn, batched, replicated=()):
        return run_kernel(kernel, backend, fn, batched, replicated)


MESH = MeshLayout()
