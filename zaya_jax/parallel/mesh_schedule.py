"""The model's `Schedule` on a device mesh: attention, experts and kernels run by the parallel schedules.

`MeshSchedule` routes each layer to `attention_schedule` (CCA) or `linear_schedule` (linear attention,
LASP-2) when tsp, tensor or sequence split it, to
`experts_schedule` (any split axis: each device sorts only its own tokens), to
`batch_map.run_kernel` (Pallas kernels shard_mapped over the batch and sequence axes), and the
embedding lookup to `embedding_schedule`. Each asks
the mesh it is traced under (`Program` traces under its own) which axes are split.
`zigzagged` says that the batch's sequence is placed zigzag (`parallel/zigzag.py`): the program
that permuted the batch builds its layout with it, so the schedules know where each chunk sits.
"""

from __future__ import annotations

import dataclasses

from zaya_jax.model.schedule import Schedule
from zaya_jax.parallel import attention_schedule, embedding_schedule, experts_schedule, linear_schedule
from zaya_jax.parallel.batch_map import run_kernel


@dataclasses.dataclass(frozen=True)
class MeshSchedule(Schedule):
    zigzagged: bool = False  # each device holds chunks p and 2D-1-p of the sequence, not chunk p

    def attention(self, params, x, seq, cfg):
        if not attention_schedule.active():
            return None
        return attention_schedule.cca(params, x, seq, cfg, zigzagged=self.zigzagged)

    def linear_attention(self, params, x, seq, cfg):
        if not attention_schedule.active():
            return None
        return linear_schedule.linear(params, x, seq, cfg, zigzagged=self.zigzagged)

    def experts(self, x, routing, gate, up, down, backend):
        if not experts_schedule.active(backend):
            return None
        return experts_schedule.experts(x, routing.expert, routing.weight, gate, up, down, backend=backend)

    def run_kernel(self, kernel, backend, fn, batched, replicated=()):
        return run_kernel(kernel, backend, fn, batched, replicated)

    def embed(self, table, ids):
        return embedding_schedule.lookup(table, ids)


MESH = MeshSchedule()
ZIGZAG = MeshSchedule(zigzagged=True)
