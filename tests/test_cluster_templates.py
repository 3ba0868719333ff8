"""`zaya template`: both job files render, parse (bash -n, YAML), carry the asked layout, and their
command lines are ones `zaya` accepts; bad input is one line on stderr, exit status 2."""

import argparse
import re
import shlex
import subprocess

import pytest
import yaml

from zaya_jax.cli import build_parser, main
from zaya_jax.cluster.templates import DEFAULTS, TEMPLATES, names, render

OTHER = dict(nodes=3, gpus_per_node=4, config="experiments/tiny_cpu.py", workdir="/shared/runs/try1", job_name="try")


def _train_args(argv):
    args, extra = build_parser().parse_known_args(argv)
    assert args.command == "train", argv
    return args, extra


def test_every_value_has_a_default():
    for kind in TEMPLATES:
        assert set(names(kind)) <= set(DEFAULTS), kind


def _srun_line(script: str) -> list[str]:
    """The srun command, its backslash continuations joined."""
    joined = script.replace("\\\n", " ")
    line = next(line for line in joined.splitlines() if line.startswith("srun "))
    return shlex.split(line)


@pytest.mark.parametrize("values", [{}, OTHER], ids=["defaults", "other"])
def test_slurm_script(values, tmp_path):
    want = DEFAULTS | values
    script = render("slurm", **values)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert f"#SBATCH --nodes={want['nodes']}\n" in script
    assert f"#SBATCH --ntasks-per-node={want['gpus_per_node']}\n" in script  # one task per GPU
    assert f"#SBATCH --gpus-per-node={want['gpus_per_node']}\n" in script
    assert re.search(r"^#SBATCH --signal=TERM@\d+$", script, re.M)
    assert "##SBATCH --partition=" in script  # unset: commented out, the cluster's default
    argv = _srun_line(script)
    args, extra = _train_args(argv[argv.index("zaya") + 1:])
    assert (args.config, args.workdir) == (want["config"], want["workdir"])
    assert all(e.startswith("--config.") for e in extra), extra


FAKE = {"srun": "#!/bin/bash\nexit $FAKE_STATUS\n",
        "scontrol": "#!/bin/bash\necho \"$@\" >> \"$FAKE_LOG\"\n"}


@pytest.mark.parametrize("status,restarts,requeued", [
    (0, 0, False), (1, 0, True), (3, 4, True), (137, 0, True), (1, 5, False), (2, 0, False), (4, 0, False),
    (143, 0, False)])
def test_slurm_script_requeues_by_the_exit_status_contract(tmp_path, status, restarts, requeued):
    """The rendered script, run with stand-ins for srun (exits with the run's status) and scontrol."""
    for name, body in FAKE.items():
        (tmp_path / name).write_text(body)
        (tmp_path / name).chmod(0o755)
    (tmp_path / "job.sbatch").write_text(render("slurm", max_restarts=5))
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "FAKE_STATUS": str(status), "FAKE_LOG": str(tmp_path / "log"),
           "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": str(restarts)}
    done = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True)
    assert done.returncode == status
    calls = (tmp_path / "log").read_text().splitlines() if (tmp_path / "log").exists() else []
    assert calls == (["requeue 77"] if requeued else [])


def test_slurm_set_options():
    script = render("slurm", partition="gpu", account="proj1", time="02:00:00")
    for line in ("#SBATCH --partition=gpu", "#SBATCH --account=proj1", "#SBATCH --time=02:00:00"):
        assert line + "\n" in script


def _launch_parsed(argv):
    """The launch subcommand's parse, when `zaya launch` exists (it may be added after this test)."""
    parser = build_parser()
    jobs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if "launch" not in jobs.choices:
        return None
    args, _ = parser.parse_known_args(argv)
    return args


@pytest.mark.parametrize("values", [{}, OTHER | {"image": "reg.io/zaya:1", "gpu_resource": "nvidia.com/gpu"}],
                         ids=["defaults", "other"])
def test_k8s_jobset(values):
    want = DEFAULTS | values
    nodes, gpus = want["nodes"], want["gpus_per_node"]
    docs = [d for d in yaml.safe_load_all(render("k8s", **values)) if d is not None]
    assert len(docs) == 1
    jobset = docs[0]
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert jobset["metadata"]["name"] == want["job_name"]
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    [replicated] = jobset["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    assert job["parallelism"] == job["completions"] == nodes
    assert job["completionMode"] == "Indexed"
    # Exit statuses 2 and 4 never restart (zaya_jax/exit_codes.py): they fail the Job, which fails the JobSet.
    [rule] = job["podFailurePolicy"]["rules"]
    assert (rule["action"], rule["onExitCodes"]["operator"], rule["onExitCodes"]["values"]) == ("FailJob", "In", [2, 4])
    assert rule["onExitCodes"]["containerName"] == "zaya"
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == want["max_restarts"]
    assert policy["rules"] == [{"action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}]
    pod = job["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == want["image"]
    assert container["resources"]["limits"] == {want["gpu_resource"]: str(gpus)}
    assert all(isinstance(a, str) for a in container["command"])  # Kubernetes takes strings only

    # The node rank is a $(VAR) the kubelet fills from the Indexed Job's completion index.
    env = {e["name"]: e for e in container["env"]}
    command = [re.sub(r"\$\((\w+)\)", "5", a) for a in container["command"]]
    rank_var = re.fullmatch(r"\$\((\w+)\)", container["command"][container["command"].index("--node-rank") + 1])[1]
    assert "job-completion-index" in env[rank_var]["valueFrom"]["fieldRef"]["fieldPath"]

    host = f"{want['job_name']}-{replicated['name']}-0-0.{want['job_name']}"  # JobSet's name for pod 0
    assert command[:2] == ["zaya", "launch"]
    launch, train = command[1:command.index("--")], command[command.index("--") + 1:]
    assert launch == ["launch", "-n", str(gpus), "--nodes", str(nodes), "--node-rank", "5",
                      "--coordinator-address", f"{host}:{want['port']}"]
    args, extra = _train_args(train)
    assert (args.config, args.workdir) == (want["config"], want["workdir"])
    assert args.workdir.startswith(want["shared_mount"] + "/")
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[want["shared_mount"]] in {v["name"] for v in pod["volumes"]}

    parsed = _launch_parsed(command[1:])  # argparse exits on a line it does not accept
    if parsed is not None:  # zaya launch exists: its values are the ones written
        for name, value in (("nodes", nodes), ("node_rank", 5), ("coordinator_address", f"{host}:{want['port']}")):
            if hasattr(parsed, name):
                assert str(getattr(parsed, name)) == str(value), name


def test_cli_prints_and_writes(capsys, tmp_path):
    assert main(["template", "slurm", "--nodes=2", "--gpus-per-node=4", "--set", "partition=gpu"]) == 0
    out = capsys.readouterr().out
    assert out == render("slurm", nodes=2, gpus_per_node=4, partition="gpu")
    target = tmp_path / "jobset.yaml"
    assert main(["template", "k8s", "--image=reg.io/z:1", f"--out={target}"]) == 0
    assert target.read_text() == render("k8s", image="reg.io/z:1")
    assert "kubectl apply -f" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["template", "pbs"],
    ["template", "slurm", "--nodes=0"],
    ["template", "k8s", "--gpus-per-node=-1"],
    ["template", "slurm", "--image=reg.io/z:1"],  # the SLURM script has no image
    ["template", "k8s", "--workdir=/tmp/run"],  # not on the shared volume
    ["template", "slurm", "--workdir=/my runs/x"],
    ["template", "k8s", "--set", "job_name=Bad_Name"],
    ["template", "slurm", "--set", "nodes"],
    ["template", "slurm", "--bogus"],
])
def test_bad_input_is_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("zaya: error: ") and err.count("\n") == 1, err
