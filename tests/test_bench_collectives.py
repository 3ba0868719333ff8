"""`zaya bench collectives` on 8 fake CPU devices: the ops, busbw, tiers, the file `zaya mesh` reads, errors."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zaya_jax.bench import collectives as bc
from zaya_jax.bench import command
from zaya_jax.cli import build_parser, main
from zaya_jax.errors import ZayaError
from zaya_jax.explore.collectives import OPS, load_curves
from zaya_jax.parallel.mesh import build_mesh, resolve_axis_sizes
from zaya_jax.parallel.topology import Topology
from meshes import mesh_sizes

FAST = ["--sizes", "1KiB,4KiB", "--iters", "1", "--warmup", "0"]


class TwoNodes(Topology):
    """One process holds all 8 fake devices; pretend devices 0-3 are one node and 4-7 another."""

    def node_of(self, device) -> int:
        return device.id // 4


def mesh_of(**axes):
    return build_mesh(resolve_axis_sizes(mesh_sizes(**axes), 8), jax.devices())


def bench(tmp_path, *flags, topology=None):
    """Run the command in-process with a chosen topology; return the records it wrote."""
    out = tmp_path / "c.json"
    args = build_parser().parse_args(["bench", "collectives", *flags, "--out", str(out)])
    assert command.bench_command(args, [], devices=None, topology=topology) == 0
    return json.loads(out.read_text())


def test_busbw_follows_nccl_tests():
    # 1 GB in 10 ms: algbw 100 GB/s
    assert bc.busbw_gb_per_s("all_gather", 8, 10**9, 0.01) == pytest.approx(87.5)
    assert bc.busbw_gb_per_s("reduce_scatter", 4, 10**9, 0.01) == pytest.approx(75.0)
    assert bc.busbw_gb_per_s("all_to_all", 2, 10**9, 0.01) == pytest.approx(50.0)
    assert bc.busbw_gb_per_s("all_reduce", 8, 10**9, 0.01) == pytest.approx(175.0)
    assert bc.busbw_gb_per_s("permute", 8, 10**9, 0.01) == pytest.approx(100.0)  # explorer: bytes / busbw


def test_tier_is_inter_when_any_group_crosses_a_node():
    assert bc.tier_of([[0, 0, 0], [1, 1, 1]]) == "intra"
    assert bc.tier_of([[0, 1], [0, 1]]) == "inter"
    assert bc.tier_of([[0, 0], [0, 1]]) == "inter"  # mixed: one group crosses


def test_axis_groups_follow_build_mesh_placement():
    mesh = mesh_of(data=2, fsdp=4)
    ids = lambda axis: [[d.id for d in g] for g in bc.axis_groups(mesh, axis)]
    assert ids("fsdp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ids("data") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("op", OPS)
def test_each_op_moves_the_data_it_claims(op):
    """Over fsdp (4) with data (2) as independent groups; shard k = data k//4, fsdp k%4."""
    mesh, n, elements = mesh_of(data=2, fsdp=4), 4, 8
    fn, x = bc.compiled(mesh, "fsdp", op, elements)
    local = x.shape[0] // 8
    assert local == (elements // n if op == "all_gather" else elements)
    blocks = np.arange(8 * local, dtype=np.float32).reshape(8, local)
    out = np.asarray(fn(jax.device_put(blocks.ravel(), NamedSharding(mesh, P(mesh.axis_names))))).reshape(8, -1)
    for k in range(8):
        group, f = blocks[k // 4 * 4: k // 4 * 4 + 4], k % 4
        expected = {"all_gather": lambda: group.ravel(),
                    "reduce_scatter": lambda: group.sum(0).reshape(n, -1)[f],
                    "all_reduce": lambda: group.sum(0),
                    "all_to_all": lambda: group.reshape(n, n, -1)[:, f].ravel(),
                    "permute": lambda: group[(f - 1) % n]}[op]
        np.testing.assert_array_equal(out[k], expected())


def test_records_name_every_axis_op_and_size_with_real_tiers(tmp_path):
    records = bench(tmp_path, "--mesh", "data=2,fsdp=4", *FAST, topology=TwoNodes((0,)))
    got = [(r["op"], r["axis"], r["group"], r["tier"], r["bytes"]) for r in records]
    assert got == [(op, axis, n, tier, size) for axis, n, tier in (("data", 2, "inter"), ("fsdp", 4, "intra"))
                   for op in OPS for size in (1024, 4096)]
    assert all(r["busbw_gb_per_s"] > 0 and r["time_us"] > 0 for r in records)
    r = records[0]
    assert r["busbw_gb_per_s"] == pytest.approx(bc.busbw_gb_per_s(r["op"], r["group"], r["bytes"], r["time_us"] / 1e6))


def test_default_mesh_is_node_inside_and_nodes_across(tmp_path):
    one_node = bench(tmp_path, "--ops", "all_reduce", *FAST)
    assert {(r["axis"], r["group"], r["tier"]) for r in one_node} == {("fsdp", 8, "intra")}
    two_nodes = bench(tmp_path, "--ops", "all_reduce", *FAST, topology=TwoNodes((0,)))
    assert {(r["axis"], r["group"], r["tier"]) for r in two_nodes} == {("data", 2, "inter"), ("fsdp", 4, "intra")}


def test_group_partly_across_nodes_is_inter_and_sizes_are_rounded(tmp_path):
    records = bench(tmp_path, "--mesh", "fsdp=-1", "--ops", "permute", "--sizes", "100,1000", "--iters", "1",
                    topology=TwoNodes((0,)))
    assert [(r["axis"], r["group"], r["tier"], r["bytes"]) for r in records] == [
        ("fsdp", 8, "inter", 4 * 24), ("fsdp", 8, "inter", 4 * 248)]  # float32 counts divisible by 8


def test_cli_file_is_what_zaya_mesh_reads(tmp_path, capsys):
    out, plain, measured = tmp_path / "c.json", tmp_path / "plain.json", tmp_path / "measured.json"
    assert main(["bench", "collectives", *FAST, "--ops", "all_gather,reduce_scatter,all_reduce", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "all_gather      fsdp          8  intra       1KiB" in printed and f"wrote {out} (6 records)" in printed
    curves = load_curves(str(out))
    record = json.loads(out.read_text())[0]
    assert curves.busbw("intra", "all_gather", 8, 1024) == pytest.approx(record["busbw_gb_per_s"])
    mesh = ["mesh", "--config", "experiments/tiny_cpu.py", "--hardware", "cpu", "--top", "1"]
    assert main(mesh + ["--json", str(plain)]) == 0
    assert main(mesh + ["--json", str(measured), "--collectives", str(out)]) == 0
    step = lambda path: {p["layout"]["fsdp"]: p["predicted"]["step_time_s"] for p in json.loads(path.read_text())}
    assert step(measured)[8] != step(plain)[8]  # fsdp 8's gathers were priced with the measured busbw


@pytest.mark.parametrize("flags, words", [
    (["--ops", "all_gather,broadcast"], "unknown collective 'broadcast'"),
    (["--mesh", "data=two"], "data=two is not a size"),
    (["--mesh", "dp=8"], "'dp=8' is not AXIS=SIZE"),
    (["--mesh", "data=2,data=4"], "names data twice"),
    (["--mesh", "data=-1,fsdp=-1"], "more than one -1"),
    (["--mesh", "data=3"], "needs 3 devices but this run has 8"),
    (["--mesh", "data=3,fsdp=-1"], "does not divide 8"),
    (["--sizes", "1KiB,12XB"], "'12XB' is not a positive size"),
    (["--sizes", "0"], "'0' is not a positive size"),
    (["--iters", "0"], "--iters must be at least 1"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_input_is_one_line_error(tmp_path, capsys, flags, words):
    out = tmp_path / "c.json"
    assert main(["bench", "collectives", *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zaya: error: ") and err.strip().count("\n") == 0 and words in err, err
    assert not out.exists()


@pytest.mark.parametrize("where, words", [("missing/c.json", "does not exist"), (".", "is a folder")])
def test_unwritable_out_fails_before_measuring(tmp_path, capsys, where, words):
    assert main(["bench", "collectives", *FAST, "--out", str(tmp_path / where)]) == 2
    captured = capsys.readouterr()
    assert words in captured.err and captured.err.strip().count("\n") == 0
    assert "all_gather" not in captured.out  # nothing was measured


def test_one_device_has_nothing_to_measure(tmp_path):
    args = build_parser().parse_args(["bench", "collectives", "--out", str(tmp_path / "c.json")])
    with pytest.raises(ZayaError, match="nothing to measure"):
        command.bench_command(args, [], devices=jax.devices()[:1])
