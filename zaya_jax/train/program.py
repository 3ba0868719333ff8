"""The compiled training program of an experiment on a mesh: shardings, init, train/eval steps.

`Program` ties a validated experiment to a device mesh: it builds the optimizer, the
shardings of every state leaf (from the logical → mesh rules), the initial state placed
directly on the devices, and the jitted train and eval steps. `abstract_state()` and
`compile_train_step()` work from shapes alone, so a full-size model can be compiled for a
target mesh without allocating it (see `tools/compile_step.py`).

The program also names its kernel target (`kernels.registry.TARGETS`): by default the platform
of its mesh's devices. Its steps are traced under that target, so `auto` kernels, Pallas
interpret mode and block sizes follow the devices the program runs on, never a global probe.
A program built on CPU devices for target `cuda` or `rocm` cannot run, but it can be lowered
for that GPU (`lower_train_step`, `tools/lower_for_gpu.py`): the Pallas → Triton check on CPU.

With the sequence split (`tsp` x `sequence` > 1) and `mesh.zigzag` on, the program places every
batch zigzag (`parallel/zigzag.py`): `place_batch` and `place_eval_batch` permute the columns of
every batch key (positions and segment ids included) once, on the host, and the model's schedule
knows it (`MeshSchedule.zigzagged`). The loss and metrics are sums over tokens: order-free.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from zaya_jax.errors import ZayaError
from zaya_jax.experiment import Experiment, load_experiment
from zaya_jax.experiment.schema import balance_lr
from zaya_jax.kernels.gpu_lowering import checked_lowering, lowering_device
from zaya_jax.kernels.registry import GPU_TARGETS, KERNEL_FIELDS, device_target, resolve, targeting
from zaya_jax.parallel.mesh import mesh_for
from zaya_jax.parallel import zigzag
from zaya_jax.parallel.axes import SEQUENCE_AXES
from zaya_jax.parallel.mesh_schedule import MeshSchedule
from zaya_jax.parallel.muon_spread import spread_matrices
from zaya_jax.parallel.grad_reduction import reduce_once
from zaya_jax.parallel.rules import data_split_dim, named_sharding, split_over_data
from zaya_jax.train import balancing, step_guard
from zaya_jax.train.flat_model import ModelDef, init_arrays, model_def
from zaya_jax.train.loss import token_loss
from zaya_jax.train.optim import build_optimizer
from zaya_jax.train.step import (BATCH_KEYS, StepConfig, TrainState, init_state, make_eval_step,
                                 make_gradient_step, make_score_step, make_train_step, make_update_step)


@dataclasses.dataclass
class Program:
    exp: Experiment
    mesh: Mesh
    modeldef: ModelDef
    target: str | None = None  # kernel target; None: the platform of the mesh's devices

    def __post_init__(self):
        c = self.exp.config
        self.target = self.target or self.devices_target
        self.data_split = self._data_split()
        self.sequence_devices = math.prod(self.mesh.shape[a] for a in SEQUENCE_AXES)
        self.zigzagged = zigzag.zigzagged(c.mesh.zigzag, self.sequence_devices)
        # Muon's matrices start and end where their optimizer state lives.
        held = {k: (s.spec, self.modeldef.param_shapes[k]) for k, s in self.optimizer_shardings().items()}
        self.tx, self.lr_schedule = build_optimizer(c.optim, c.train.steps, self.modeldef.param_axes,
                                                    spread=spread_matrices(self.mesh, held), target=self.target)
        self.balancer = balancing.balancer(c.optim.balancer, balance_lr(c.optim), c.optim.balance_b1,
                                           c.optim.balance_b2)
        # The mesh's schedules run the layers; they look at which axes are split when traced.
        self.step_cfg = StepConfig(remat=c.train.remat, scan_layers=c.train.scan_layers,
                                   scan_unroll=c.train.scan_unroll, vocab_chunk=c.train.loss_vocab_chunk,
                                   schedule=MeshSchedule(zigzagged=self.zigzagged),
                                   loss=token_loss,
                                   guard=step_guard.GuardSettings.from_config(c.fault),
                                   reduction=self._reduction(), param_shardings=self.param_shardings())
        self._rows: dict[int, list[int]] = {}  # local_rows by batch size: asked every step
        self._abstract = jax.eval_shape(self._init)  # traced once: shardings and AOT compile share it
        self.state_shardings = self._state_shardings()
        self._train_step = None

    # ---- shapes and shardings --------------------------------------------------------------
    @property
    def micro_batch(self) -> int:
        return self.exp.config.train.global_batch_size // self.exp.config.train.grad_accum_steps

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def param_shardings(self) -> dict[str, NamedSharding]:
        shapes = self.modeldef.param_shapes
        return {k: named_sharding(axes, self.mesh, shapes[k]) for k, axes in self.modeldef.param_axes.items()}

    def batch_sharding(self, accumulated: bool = True) -> NamedSharding:
        spec = named_sharding(("batch", "length"), self.mesh).spec
        return NamedSharding(self.mesh, PartitionSpec(None, *spec) if accumulated else spec)

    def abstract_state(self) -> TrainState:
        return self._abstract

    def _init(self) -> TrainState:
        params, biases = init_arrays(self.modeldef.cfg, self.exp.config.train.seed)
        return init_state(params, biases, self.modeldef.bias_key, self.tx, self.balancer, self.step_cfg.guard)

    def _reduction(self):
        """How the step reduces gradients over `data`: with several micro-batches, once after the
        loop (`parallel/grad_reduction.py`); with one, GSPMD's reductions inside the backward, which
        XLA can overlap with the layers still to differentiate (a reduction after the loop cannot)."""
        if self.exp.config.train.grad_accum_steps == 1:
            return None
        return functools.partial(reduce_once, scatter=self.data_split,
                                 specs={k: s.spec for k, s in self.param_shardings().items()})

    def _data_split(self) -> dict[str, int | None]:
        """ZeRO-1 (`optim.shard_over_data`): per parameter, the dimension its optimizer state and
        reduced gradient split over `data` (None: kept whole, as every one is with the setting off)."""
        shapes, on = self.modeldef.param_shapes, self.exp.config.optim.shard_over_data
        return {k: data_split_dim(s.spec, shapes[k], self.mesh) if on else None
                for k, s in self.param_shardings().items()}

    def optimizer_shardings(self) -> dict[str, NamedSharding]:
        """Where each parameter's optimizer state lives: its own sharding, split over `data` by ZeRO-1."""
        shapes = self.modeldef.param_shapes
        return {k: NamedSharding(self.mesh, split_over_data(s.spec, self.data_split[k], len(shapes[k])))
                for k, s in self.param_shardings().items()}

    def _state_shardings(self) -> TrainState:
        """Optimizer moments follow their parameter's sharding (ZeRO-1: split over `data` too);
        everything else is replicated."""
        by_state = self.optimizer_shardings()
        shapes = self.modeldef.param_shapes

        def pick(path, leaf):
            keys = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
            for key in reversed(keys):
                if key in by_state and tuple(leaf.shape) == shapes[key]:
                    return by_state[key]
            return self.replicated()

        shardings = jax.tree_util.tree_map_with_path(pick, self._abstract)
        return dataclasses.replace(shardings, params=self.param_shardings())

    def abstract_batch(self, eval_size: int | None = None) -> dict[str, jax.ShapeDtypeStruct]:
        """A train step's batch ([A, micro, S]), or with `eval_size` a held-out batch ([size, S])."""
        c = self.exp.config.train
        shape = (c.grad_accum_steps, self.micro_batch, c.seq_len) if eval_size is None else (eval_size, c.seq_len)
        dtypes = {"loss_mask": jnp.float32}
        sharding = self.batch_sharding(accumulated=eval_size is None)
        return {k: jax.ShapeDtypeStruct(shape, dtypes.get(k, jnp.int32), sharding=sharding) for k in BATCH_KEYS}

    # ---- programs ---------------------------------------------------------------------------
    def init(self) -> TrainState:
        """The initial state, created directly in its sharded placement."""
        return jax.jit(self._init, out_shardings=self.state_shardings)()

    def fresh_guard(self) -> step_guard.GuardState:
        """An empty bad-step guard, placed (for a checkpoint saved before the guard existed)."""
        return jax.device_put(step_guard.init(self.step_cfg.guard), self.state_shardings.guard)

    def jitted_train_step(self):
        step = self._under_mesh(make_train_step(self.modeldef, self.tx, self.balancer, self.lr_schedule,
                                                self.step_cfg))
        return jax.jit(step, in_shardings=(self.state_shardings, self.batch_sharding()),
                       out_shardings=(self.state_shardings, self.replicated()), donate_argnums=0)

    def jitted_gradient_step(self):
        """The train step's first half alone, `(params, biases, batches) -> (grads, sums)`: the
        forward and backward of every micro-batch and the reduction (benchmarks time it apart)."""
        step = self._under_mesh(make_gradient_step(self.modeldef, self.step_cfg))
        return jax.jit(step, in_shardings=(self.state_shardings.params, self.state_shardings.biases,
                                           self.batch_sharding()))

    def jitted_update_step(self):
        """The train step's second half alone, `(state, grads, sums, batches) -> (state, metrics)`, the
        state donated."""
        step = self._under_mesh(make_update_step(self.modeldef, self.tx, self.balancer, self.lr_schedule,
                                                 self.step_cfg))
        return jax.jit(step, in_shardings=(self.state_shardings, self.state_shardings.params, None,
                                           self.batch_sharding()),
                       out_shardings=(self.state_shardings, self.replicated()), donate_argnums=0)

    def _under_mesh(self, fn):
        """fn traced with this mesh and kernel target in context, so kernels that GSPMD cannot
        partition can shard_map themselves over it (`parallel/batch_map.py`) and kernels are built
        for the devices the program runs on."""
        mesh = self.mesh.abstract_mesh
        if not self.runs_here() and self.target in GPU_TARGETS:  # lowered for a GPU from elsewhere
            mesh = mesh.update(abstract_device=lowering_device(self.target))

        @functools.wraps(fn)
        def traced(*args):
            with jax.sharding.use_abstract_mesh(mesh), targeting(self.target):
                return fn(*args)

        return traced

    def placed_abstract_state(self) -> TrainState:
        """Shapes, dtypes and this mesh's shardings: the target a checkpoint is restored into."""
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            self.abstract_state(), self.state_shardings)

    @property
    def devices_target(self) -> str:
        """The kernel target of the mesh's own devices."""
        return device_target(self.mesh.devices.flat[0])

    def runs_here(self) -> bool:
        """True when the kernel target is the mesh devices' own platform (the program can compile and run)."""
        return self.target == self.devices_target

    def kernels(self) -> dict[str, str]:
        """The backend each kernel runs with in this program: what the config's names (`auto`
        included) resolve to on its kernel target."""
        with targeting(self.target):
            return {kernel: resolve(kernel, getattr(self.modeldef.cfg, field))
                    for field, kernel in KERNEL_FIELDS.items()}

    def _traced_train_step(self):
        return self.jitted_train_step().trace(self.placed_abstract_state(), self.abstract_batch())

    def lower_train_step(self, platform: str | None = None):
        """The train step lowered from abstract shapes for `platform` (default: the kernel target)."""
        platform = platform or self.target
        with checked_lowering(platform):
            return self._traced_train_step().lower(lowering_platforms=(platform,))

    def compile_train_step(self):
        """AOT-compile the train step from abstract shapes; returns (compiled, seconds)."""
        compiled, phases = self.compile_train_step_phases()
        return compiled, sum(phases.values())

    def compile_train_step_phases(self, compiler_options: dict | None = None):
        """AOT-compile the train step; returns (compiled, {"trace_s", "lower_s", "compile_s"}).
        `compiler_options` go to XLA (e.g. its dump, `explore/xla_terms.py`).

        Trace is Python (the model and schedules traced into a jaxpr), lower is the jaxpr to
        StableHLO (where Pallas kernels become Triton), compile is XLA (or the persistent
        compilation cache, which serves this phase only)."""
        if not self.runs_here():
            raise ZayaError(f"this program's kernels target {self.target} but its devices are "
                            f"{self.devices_target}: it can be lowered, not compiled")
        clock = [time.perf_counter()]
        traced = self._traced_train_step()
        clock.append(time.perf_counter())
        with checked_lowering(self.target):
            lowered = traced.lower()
        clock.append(time.perf_counter())
        compiled = lowered.compile(compiler_options=compiler_options)
        clock.append(time.perf_counter())
        spans = [round(b - a, 2) for a, b in zip(clock, clock[1:])]
        return compiled, dict(zip(("trace_s", "lower_s", "compile_s"), spans))

    def jitted_eval_step(self):
        step = self._under_mesh(make_eval_step(self.modeldef, self.step_cfg))
        params_sh = self.state_shardings.params
        biases_sh = self.state_shardings.biases
        return jax.jit(step, in_shardings=(params_sh, biases_sh, self.batch_sharding(accumulated=False)),
                       out_shardings=self.replicated())

    def jitted_score_step(self):
        """Per-row log-likelihoods and greedy flags of a [size, S] batch (`step.make_score_step`)."""
        step = self._under_mesh(make_score_step(self.modeldef, self.step_cfg))
        return jax.jit(step, in_shardings=(self.state_shardings.params, self.state_shardings.biases,
                                           self.batch_sharding(accumulated=False)), out_shardings=self.replicated())

    def local_rows(self, rows: int) -> list[int]:
        """The rows of a [rows, seq_len] batch (one micro-batch) held by this process's devices.

        Processes whose devices split only sequence, tsp or tensor of the same rows hold, and so
        read, the same rows; the others hold disjoint ones."""
        if rows not in self._rows:
            shape = (rows, self.exp.config.train.seq_len)
            held = set()
            for index in self.batch_sharding(accumulated=False).addressable_devices_indices_map(shape).values():
                held.update(range(*index[0].indices(rows)))
            self._rows[rows] = sorted(held)
        return self._rows[rows]

    def data_lanes(self) -> list[int]:
        """The lanes (rows of the global batch, `data/lanes.py`) this process reads, micro-batch
        by micro-batch: the rows `place_batch` takes, in its order."""
        micro = self.micro_batch
        return [a * micro + r for a in range(self.exp.config.train.grad_accum_steps) for r in self.local_rows(micro)]

    def compile_eval_step(self, size: int):
        """The held-out step AOT-compiled for [size, S] batches (so no process compiles mid-run)."""
        state = self.placed_abstract_state()
        return self.jitted_eval_step().trace(state.params, state.biases, self.abstract_batch(size)).lower().compile()

    def place_batch(self, batch: dict) -> dict:
        """This process's rows of a train step (`data_lanes()` order) → global [A, micro, S] arrays,
        the sequence in device order (`_placed`)."""
        c = self.exp.config.train
        shape = (c.grad_accum_steps, self.micro_batch, c.seq_len)
        rows = self.local_rows(self.micro_batch)
        sharding = self.batch_sharding()
        local = {k: v.reshape(c.grad_accum_steps, len(rows), *v.shape[1:])
                 for k, v in self._placed(batch).items()}
        return {k: _global_array(local[k], shape, sharding, rows, 1) for k in BATCH_KEYS}

    def place_eval_batch(self, batch: dict, size: int) -> dict:
        """This process's rows (`local_rows(size)` order) of a [size, S] held-out batch → global arrays,
        the sequence in device order (`_placed`)."""
        shape = (size, self.exp.config.train.seq_len)
        rows = self.local_rows(size)
        sharding = self.batch_sharding(accumulated=False)
        placed = self._placed(batch)
        return {k: _global_array(placed[k], shape, sharding, rows, 0) for k in BATCH_KEYS}

    def _placed(self, batch: dict) -> dict:
        """The batch with its sequence columns in device order: zigzag, or as they are."""
        if not self.zigzagged:
            return batch
        return {k: zigzag.place(np.asarray(v), self.sequence_devices, True) for k, v in batch.items()}


def _global_array(local, shape, sharding, rows: list[int], row_dim: int):
    """A global array whose `row_dim` rows `rows` are `local`'s, each device given its slice."""
    position = {r: i for i, r in enumerate(rows)}

    def piece(index):
        index = list(index)
        index[row_dim] = [position[r] for r in range(*index[row_dim].indices(shape[row_dim]))]
        return local[tuple(index)]

    return jax.make_array_from_callback(shape, sharding, piece)


def build_program(exp: Experiment, devices=None, target: str | None = None) -> Program:
    """The program of `exp` on `devices` (default all), its kernels built for `target` (default theirs)."""
    c = exp.config
    micro = c.train.global_batch_size // c.train.grad_accum_steps
    mesh = mesh_for(dict(c.mesh), exp.model, micro, c.train.seq_len, devices, zigzag=c.mesh.zigzag)
    return Program(exp, mesh, model_def(exp.model), target)


def program_for_target(config: str, overrides, target: str, devices=None) -> Program:
    """The program of an experiment file with its kernels built, and validated, for `target`: e.g.
    a CUDA or ROCm program on this machine's CPU devices, to lower (`tools/lower_for_gpu.py`)."""
    with targeting(target):  # backends are checked against the target, not this machine
        exp = load_experiment(config, list(overrides))
    return build_program(exp, devices, target)

