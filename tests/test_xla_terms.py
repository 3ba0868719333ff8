"""XLA's buffers at a compiled step's peak, attributed to the explorer's terms (`explore/xla_terms.py`):
the terms sum to XLA's own total; the step's arguments land in parameters, optimizer and inputs
to the byte (copies XLA makes of them included); what the forward keeps for the backward is a
stored activation, what the backward makes is its working set or, shaped like a parameter, a
gradient; `zaya mesh --validate --terms` prints the comparison and writes it to its JSON."""

import json

import jax
import jax.numpy as jnp
import pytest

from paths import TINY
from zaya_jax.explore import xla_terms
from zaya_process import zaya

SMALL = ["--config.train.seq_len=64", "--config.train.global_batch_size=8", "--config.model.num_hidden_layers=2"]


def _attributed(fn, *args):
    with xla_terms.dumping() as (options, read_peak):
        compiled = jax.jit(fn).trace(*args).lower().compile(compiler_options=options)
        buffers = read_peak()
    return xla_terms.attribute(buffers, xla_terms.total_bytes(compiled)), buffers, compiled


def test_a_small_training_steps_buffers_land_in_their_terms():
    """Two tanh layers: the forward's [512, 256] activations are kept for the backward, which makes
    the [256, 256] weight gradients; the weights are the arguments."""
    def loss(w, x):
        with jax.named_scope("block"):
            h = jnp.tanh(x @ w[0])
            h = jnp.tanh(h @ w[1])
        return jnp.sum(h ** 2)

    def step(w, x):
        return jax.tree.map(lambda p, g: p - 0.1 * g, w, jax.grad(loss)(w, x))

    w = [jnp.ones((256, 256)) * 0.01, jnp.ones((256, 256)) * 0.01]
    x = jnp.ones((512, 256))
    terms, buffers, compiled = _attributed(step, w, x)
    assert set(terms) == set(xla_terms.TERMS)
    assert sum(terms.values()) == xla_terms.total_bytes(compiled)
    assert terms["fragmentation"] >= 0
    activation = 512 * 256 * 4
    assert terms["stored_activations"] >= activation  # at least one tanh output, waiting for the backward
    assert terms["block_working_set"] + terms["gradients"] + terms["stored_activations"] >= 2 * activation


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    out = tmp_path_factory.mktemp("terms") / "layouts.json"
    result = zaya("mesh", f"--config={TINY}", "--hardware=cpu", "--top=2", "--validate", "--terms", f"--json={out}",
                  *SMALL, devices=8)
    assert result.returncode == 0, result.stderr
    return result, [r for r in json.loads(out.read_text()) if "xla" in r]


def test_arguments_are_attributed_to_the_byte_and_the_terms_sum_to_xlas_total(validated):
    _, rows = validated
    assert len(rows) == 2
    for row in rows:
        xla, predicted = row["xla"], row["predicted"]
        terms = xla["terms"]
        assert sum(terms.values()) == xla["argument_bytes"] + xla["temp_bytes"] + xla["output_bytes"] - xla["alias_bytes"]
        # The explorer's parameter and optimizer bytes are exact (tests/test_mesh_validate.py), so the
        # attribution of the step's arguments (and of XLA's copies of them) must meet them.
        assert terms["parameters"] == pytest.approx(predicted["param_bytes"], rel=0.01), row["layout"]
        assert terms["optimizer"] == pytest.approx(predicted["optimizer_bytes"], rel=0.01), row["layout"]
        # XLA's own copies between loop buffers, which no op names: 1.02% of the step on jax 0.12's
        # XLA:CPU (65 KiB of 6.1 MiB), less on 0.10's.
        assert terms["stored_activations"] > 0 and terms["xla_copies"] < 0.02 * sum(terms.values())


def test_the_terms_table_is_printed_with_the_cpu_only_term_marked(validated):
    result, rows = validated
    assert "Memory per device by term, predicted against XLA's buffers at the step's peak" in result.stdout
    table = result.stdout.split("step's peak:")[1]
    for term in ("parameters", "gradients", "optimizer", "stored_activations", "block_working_set", "total"):
        assert f"  {term} " in table, term
    if any(r["xla"]["terms"]["kernel"] for r in rows):
        assert "kernel (CPU only)" in table


def test_terms_without_validate_is_one_line_and_exit_2():
    result = zaya("mesh", f"--config={TINY}", "--hardware=cpu", "--terms")
    assert result.returncode == 2 and result.stderr.strip() == \
        "zaya: error: --terms compares the prediction with XLA's compiled step; add --validate"


def test_a_copy_of_an_argument_is_the_arguments(tmp_path):
    """XLA copies a donated argument it must read while the output overwrites it; the copy has no
    op name of its own and takes its source's."""
    hlo = ('  %param.3 = f32[4,4]{1,0} parameter(0), metadata={op_name="state.opt_state[0].mu[' + "\\'w\\'" + ']"}\n'
           '  %copy.7 = f32[4,4]{1,0} copy(%param.3)\n'
           '  %copy.8 = f32[4,4]{1,0} copy(%copy.7)\n')
    path = tmp_path / "m.txt"
    path.write_text(hlo)
    table, _ = xla_terms._instructions(str(path))
    assert table["copy.8"] == ("f32[4,4]", "copy", "state.opt_state[0].mu['w']")
    buffer = xla_terms.Buffer("copy.8", 64, *table["copy.8"])
    assert xla_terms.term_of(buffer, set()) == "optimizer"


def test_the_experts_fused_gate_and_up_gradient_is_a_gradient_not_a_kernel_buffer():
    """The grouped matmul's weight gradient comes out for gate and up together, [E, H, 2I]: a shape
    no parameter has, made inside the CPU-only scope of the `xla` backend."""
    gate = xla_terms.Buffer("param.1", 4 * 4 * 128 * 64 * 4, "f32[4,4,128,64]", "parameter",
                            "state.params['layers/moe/experts/gate']")
    fused = xla_terms.Buffer("dot.9", 4 * 128 * 128 * 4, "f32[4,128,128]", "dot",
                             "jit(train_step)/transpose(jvp())/block/moe/experts/grouped_matmul_xla/dot_general")
    expansion = xla_terms.Buffer("fusion.3", 4 * 64 * 128 * 4, "f32[4,64,128]", "fusion",
                                 "jit(train_step)/jvp()/block/moe/experts/grouped_matmul_xla/select_n")
    shapes = xla_terms._param_shapes([gate, fused, expansion])
    assert [xla_terms.term_of(b, shapes) for b in (gate, fused, expansion)] == ["parameters", "gradients", "kernel"]


def test_an_fsdp_gathered_experts_weight_gradient_is_a_gradient_not_a_kernel_buffer():
    """Under FSDP the backward's per-expert weight product is [E, H, 2I] with the whole hidden width
    (before its reduce-scatter): no parameter shard has that shape, but it is a gradient. The
    forward's masked [E, rows, K] copies in the same scope stay `kernel`."""
    gate = xla_terms.Buffer("param.1", 3 * 4 * 48 * 320 * 4, "f32[3,4,48,320]", "parameter",
                            "state.params['layers/moe/experts/gate']")
    gathered = xla_terms.Buffer("dot.2", 4 * 192 * 640 * 4, "f32[4,192,640]", "dot",
                                "jit(train_step)/transpose(jvp())/block/moe/experts/grouped_matmul_xla/dot_general")
    masked = xla_terms.Buffer("fusion.4", 4 * 512 * 192 * 4, "f32[4,512,192]", "fusion",
                              "jit(train_step)/jvp()/block/moe/experts/grouped_matmul_xla/select_n")
    shapes = xla_terms._param_shapes([gate, gathered, masked])
    assert "f32[4,192,640]" not in shapes
    assert [xla_terms.term_of(b, shapes) for b in (gathered, masked)] == ["gradients", "kernel"]


def test_a_loops_carried_buffers_are_live_at_the_peak_not_fragmentation():
    """XLA's own peak listing leaves out a loop's carried values; the peak is found over every
    assigned value, so a scan's stacked outputs and its carry count as what made them."""
    def step(w, x):
        def body(h, _):
            h = jnp.tanh(h @ w)
            return h, h  # the stacked outputs: 16 x [256, 256] f32, 4 MiB, written inside the loop
        h, ys = jax.lax.scan(body, x, None, length=16)
        return jnp.sum(ys * jnp.cos(ys)) + jnp.sum(h)

    w = jnp.ones((256, 256)) * 0.01
    x = jnp.ones((256, 256))
    terms, buffers, compiled = _attributed(jax.grad(step), w, x)
    total = xla_terms.total_bytes(compiled)
    assert sum(terms.values()) == total
    stacked = 16 * 256 * 256 * 4
    assert max(b.bytes for b in buffers) >= stacked
    assert terms["fragmentation"] < 0.1 * total


def test_ragged_dots_masked_operands_are_kernel_buffers_in_every_scope_and_rank():
    """XLA:CPU's ragged_dot masks its operand per expert, [E, rows, K], and flattens it to
    [rows, E·K] for the weight gradient; in the backward the op names read
    `transpose(jvp(grouped_matmul_xla))/select_n`. All are the kernel's; the product's own
    [rows, width] result stays an activation."""
    scopes = ("jit(train_step)/jvp()/block/moe/experts/grouped_matmul_xla/select_n",
              "jit(train_step)/transpose(jvp())/block/moe/experts/transpose(jvp(grouped_matmul_xla))/select_n",
              "jit(train_step)/transpose(jvp())/block/moe/experts/jvp(grouped_matmul_xla)/and")
    flat = [xla_terms.Buffer(f"fusion.{i}", 256 * 1280 * 4, "f32[256,1280]", "fusion", name)
            for i, name in enumerate(scopes)]
    product = xla_terms.Buffer("fusion.9", 256 * 160 * 4, "f32[256,160]", "fusion",
                               "jit(train_step)/jvp()/block/moe/experts/jvp(grouped_matmul_xla)/dot_general")
    zeroed = xla_terms.Buffer("fusion.8", 256 * 160 * 4, "f32[256,160]", "fusion",  # rows past the groups
                              "jit(train_step)/jvp()/block/moe/experts/grouped_matmul_xla/jit(_where)/select_n")
    assert [xla_terms.term_of(b, set()) for b in flat + [product, zeroed]] == \
        ["kernel"] * 3 + ["stored_activations"] * 2


def test_a_compiled_xla_grouped_matmul_backward_puts_every_masked_operand_in_kernel():
    """On XLA's own output: the experts' forward and backward through the `xla` backend, compiled
    for this CPU. At the peak every buffer a mask made is `kernel`, and they are the bulk of it."""
    from zaya_jax.model import moe

    rows, experts, hidden, width = 512, 4, 128, 64

    def loss(xs, gate_up, down, sizes):
        return jnp.sum(moe.fused_swiglu(xs, sizes, gate_up, down, "xla") ** 2)

    args = (jax.ShapeDtypeStruct((rows, hidden), jnp.float32),
            jax.ShapeDtypeStruct((experts, hidden, 2 * width), jnp.float32),
            jax.ShapeDtypeStruct((experts, width, hidden), jnp.float32), jax.ShapeDtypeStruct((experts,), jnp.int32))
    with xla_terms.dumping() as (options, read_peak):
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile(options)
        buffers = read_peak()
    # By shape: a masked operand is [experts, rows, K] or [rows, experts·K], K the hidden width or
    # the product's (fp32, or its mask); the products themselves are [rows, N].
    widths = (hidden, width, 2 * width)
    operand = {f"[{experts},{rows},{k}]" for k in widths} | {f"[{rows},{experts * k}]" for k in widths}
    in_kernel = [b for b in buffers if "grouped_matmul_xla" in b.op_name]
    masked = [b for b in in_kernel if b.shape[b.shape.index("["):] in operand]
    products = [b for b in in_kernel if b.shape in {f"f32[{rows},{n}]" for n in widths}]
    assert masked and {xla_terms.term_of(b, set()) for b in masked} == {"kernel"}
    assert "kernel" not in {xla_terms.term_of(b, set()) for b in products}
    assert sum(b.bytes for b in masked) >= 2 * experts * rows * hidden * 4  # at least two [E, rows, H] copies


def test_the_losss_backward_is_the_loss_under_its_callers_derivative():
    """The loss's custom backward rule runs in its own scope, which the caller's derivative wraps
    (`transpose(jvp(loss))`): the [512, 1024] logits it rebuilds are the loss's buffers, not a
    block's working set."""
    @jax.custom_vjp
    def loss(h, table):
        return jnp.sum(jax.nn.logsumexp(h @ table.T, axis=-1))

    @jax.named_scope("loss")
    def forward(h, table):
        return loss(h, table), (h, table)

    @jax.named_scope("loss")
    def backward(saved, g):
        h, table = saved
        probabilities = jax.nn.softmax(h @ table.T, axis=-1) * g  # [512, 1024], rebuilt
        return probabilities @ table, probabilities.T @ h

    loss.defvjp(forward, backward)
    h, table = jnp.ones((512, 128)), jnp.ones((1024, 128)) * 0.01
    terms, buffers, _ = _attributed(jax.grad(lambda h, t: loss(jnp.tanh(h), t), argnums=(0, 1)), h, table)
    rebuilt = [b for b in buffers if "transpose(jvp(loss))" in b.op_name and b.shape == "f32[512,1024]"]
    assert rebuilt, [(b.shape, b.op_name) for b in buffers]
    assert terms["loss"] >= 512 * 1024 * 4


def test_the_micro_batch_loops_running_gradient_sum_is_gradients_not_the_update():
    """With two micro-batches the step carries a running sum of the gradients through its loop, made
    under `train/step.py`'s `gradient_sum` scope, outside any derivative: at the peak it is a whole
    fp32 set of the parameters' gradients, and a gradient, not the optimizer update's."""
    from zaya_jax.experiment import load_experiment
    from zaya_jax.train.program import build_program
    from zaya_jax.train.step import GRADIENT_SUM_SCOPE

    program = build_program(load_experiment(TINY, [*SMALL, "--config.train.grad_accum_steps=2", "--config.mesh.data=1"]),
                            jax.devices()[:1])
    with xla_terms.dumping() as (options, read_peak):
        compiled, _ = program.compile_train_step_phases(options)
        buffers = read_peak()
    shapes = xla_terms._param_shapes(buffers)
    summed = [b for b in buffers if GRADIENT_SUM_SCOPE in xla_terms._scopes(b.op_name)]
    parameters = sum(b.bytes for b in buffers if b.op_name.startswith("state.params"))
    assert sum(b.bytes for b in summed) >= 0.9 * parameters, [(b.shape, b.op_name) for b in summed]
    assert {xla_terms.term_of(b, shapes) for b in summed} == {"gradients"}
    terms = xla_terms.attribute(buffers, xla_terms.total_bytes(compiled))
    assert terms["gradients"] >= sum(b.bytes for b in summed)


def test_each_phase_of_a_step_peaks_on_its_own_buffers_and_the_largest_is_the_steps_peak(tmp_path):
    """`phase_peaks` finds each phase's own peak: the forward's holds none of the loss's buffers, the
    loss's its chunks, the backward's what the blocks' backward makes, the update's none of the
    loss's working buffers (the table's gradient, which the loss's backward makes, may still wait
    for its update there: where it does is XLA's schedule); the largest of them is the step's peak
    (`peak_buffers`), to the byte."""
    from zaya_jax.experiment import load_experiment
    from zaya_jax.train.program import build_program

    program = build_program(load_experiment(TINY, [*SMALL, "--config.mesh.data=1"]), jax.devices()[:1])
    with xla_terms.dumping(str(tmp_path)) as (options, read_peak):
        program.compile_train_step_phases(options)
        step_peak = read_peak()
    by_phase = xla_terms.phase_peaks(*xla_terms.dump_files(str(tmp_path)))
    assert set(by_phase) == set(xla_terms.PHASES)
    total = {phase: sum(b.bytes for b in buffers) for phase, buffers in by_phase.items()}
    assert max(total.values()) == sum(b.bytes for b in step_peak)

    def made(phase, where):
        return sum(b.bytes for b in by_phase[phase] if xla_terms.phase_of(b.op_name) == where)

    assert made("forward", "loss") == 0
    assert made("loss", "loss") > 0
    assert made("backward", "backward") > 0
    table = f"f32[{program.modeldef.cfg.vocab_size},{program.modeldef.cfg.hidden_size}]"
    assert {b.shape for b in by_phase["update"] if xla_terms.phase_of(b.op_name) == "loss"} <= {table}
