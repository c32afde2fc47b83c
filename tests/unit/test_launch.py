"""Launch files (launch/): shell syntax, the resolved torchrun commands for 2 and 4 nodes (dry runs with
SLURM's variables faked), the Kubernetes manifest's fields; and topology placement across nodes."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from prime_spmd.config.sections import TopologyConfig
from prime_spmd.distributed.topology import plan_topology

LAUNCH = Path(__file__).resolve().parents[2] / "launch"
CONFIG = "configs/reverse_text/rl.toml"


def _dry_run(script: str, env: dict[str, str], *args: str, path: Path | None = None) -> list[str]:
    full = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NNODES", "HEAD_", "GPUS_", "INFERENCE_"))
    }
    full.update(env, DRY_RUN="1")
    if path is not None:
        full["PATH"] = f"{path}:{full['PATH']}"
    out = subprocess.run(["bash", str(LAUNCH / script), *args], env=full, capture_output=True, text=True, check=True)
    return shlex.split(out.stdout)


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize("script", ["slurm.sbatch", "torchrun_multinode.sh"])
def test_scripts_parse(script: str) -> None:
    subprocess.run(["bash", "-n", str(LAUNCH / script)], check=True)


@pytest.mark.parametrize(("nodes", "inference_nodes"), [(2, 1), (4, 1), (4, 2)])
def test_slurm_dry_run(tmp_path: Path, nodes: int, inference_nodes: int) -> None:
    # A fake scontrol expands the node list the way SLURM's does.
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/bash\n[ "$1 $2" = "show hostnames" ] && printf "gpu%02d\\n" $(seq 1 ' + str(nodes) + ")\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NODELIST": f"gpu[01-{nodes:02d}]",
        "SLURM_JOB_ID": "4242",
        "GPUS_PER_NODE": "8",
        "INFERENCE_NODES": str(inference_nodes),
    }
    cmd = _dry_run("slurm.sbatch", env, CONFIG, "--trainer.lr", "3e-4", path=tmp_path)
    assert cmd[:2] == ["srun", "--nodes"] and cmd[2] == str(nodes)
    assert "--kill-on-bad-exit=1" in cmd
    t = cmd[cmd.index("torchrun") :]
    assert _flag(t, "--nnodes") == str(nodes) and _flag(t, "--nproc-per-node") == "8"
    assert _flag(t, "--rdzv-backend") == "c10d" and _flag(t, "--rdzv-endpoint") == "gpu01:29500"
    assert _flag(t, "--rdzv-id") == "4242" and _flag(t, "--max-restarts") == "0"
    assert t[t.index("-m") + 1 : t.index("-m") + 3] == ["prime_spmd", "rl"]
    assert _flag(t, "--config") == CONFIG
    assert _flag(t, "--topology.num_inference_ranks") == str(8 * inference_nodes)
    assert t[-2:] == ["--trainer.lr", "3e-4"]  # extra flags come last, so they win
    # The layout it asks for fits: first nodes train, the rest infer, whole nodes per role.
    topo = plan_topology(TopologyConfig(num_inference_ranks=8 * inference_nodes), 8 * nodes, 0, 8)
    assert topo.trainer_ranks == list(range(8 * (nodes - inference_nodes))) and not topo.mixed_nodes()


def test_slurm_dry_run_needs_slurm_env() -> None:
    with pytest.raises(subprocess.CalledProcessError) as e:
        _dry_run("slurm.sbatch", {}, CONFIG)
    assert "SLURM_NNODES" in e.value.stderr


def test_torchrun_multinode_dry_run() -> None:
    env = {"NNODES": "2", "HEAD_ADDR": "node0", "GPUS_PER_NODE": "4", "NUM_INFERENCE_RANKS": "2"}
    cmd = _dry_run("torchrun_multinode.sh", env, CONFIG, "--trainer.max_steps", "3")
    assert cmd[0] == "torchrun" and _flag(cmd, "--nnodes") == "2" and _flag(cmd, "--nproc-per-node") == "4"
    assert _flag(cmd, "--rdzv-endpoint") == "node0:29500" and _flag(cmd, "--topology.num_inference_ranks") == "2"
    assert cmd[-2:] == ["--trainer.max_steps", "3"]


def test_k8s_manifest_names_every_field() -> None:
    svc, job = yaml.safe_load_all((LAUNCH / "k8s.yaml").read_text())
    assert (svc["kind"], job["kind"]) == ("Service", "Job")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["backoffLimit"] == 0
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    (c,) = pod["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert set(env) >= {"NNODES", "GPUS_PER_NODE", "INFERENCE_NODES", "HEAD_ADDR", "RDZV_PORT", "CONFIG", "EXTRA_FLAGS"}
    assert spec["completions"] == spec["parallelism"] == int(env["NNODES"])
    assert str(c["resources"]["limits"]["nvidia.com/gpu"]) == env["GPUS_PER_NODE"]
    assert env["HEAD_ADDR"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert int(env["RDZV_PORT"]) == svc["spec"]["ports"][0]["port"]
    assert "launch/torchrun_multinode.sh" in c["args"][0]
    # The pod's command resolves to the same torchrun line as the other launchers.
    script = c["args"][0].replace("exec ", "").replace("launch/", f"{LAUNCH}/")
    full = {**os.environ, **env, "DRY_RUN": "1"}
    out = subprocess.run(["bash", "-c", script], env=full, capture_output=True, text=True, check=True).stdout
    cmd = shlex.split(out)
    assert _flag(cmd, "--rdzv-endpoint") == "prime-spmd-0.prime-spmd:29500"
    assert _flag(cmd, "--topology.num_inference_ranks") == "8" and _flag(cmd, "--config") == env["CONFIG"]
    assert _flag(cmd, "--topology.timeout_s") == "600"


def test_topology_places_roles_by_node() -> None:
    t = plan_topology(TopologyConfig(num_inference_ranks=16, engine_tp=4), 32, 0, local_world_size=8)
    assert t.num_nodes == 4 and t.mixed_nodes() == []
    assert t.node_roles() == [
        "node 0: trainer ranks 0..7",
        "node 1: trainer ranks 8..15",
        "node 2: inference ranks 16..23",
        "node 3: inference ranks 24..31",
    ]
    mixed = plan_topology(TopologyConfig(num_inference_ranks=4), 16, 0, local_world_size=8)
    assert mixed.mixed_nodes() == [1] and mixed.node_roles()[1] == "node 1: trainer ranks 8..11, inference ranks 12..15"
    one_node = plan_topology(TopologyConfig(num_inference_ranks=1), 3, 0, local_world_size=3)
    assert one_node.num_nodes == 1 and one_node.mixed_nodes() == [0]  # one node disjoint: allowed, no warning


def test_topology_errors_across_nodes() -> None:
    with pytest.raises(ValueError, match=r"engine on ranks 4..9 spans two nodes \(8 ranks per node\)"):
        plan_topology(TopologyConfig(num_inference_ranks=12, engine_tp=6), 16, 0, local_world_size=8)
    uneven = plan_topology(TopologyConfig(num_inference_ranks=4), 12, 0, local_world_size=8)  # agents of 8 + 4 ranks
    assert uneven.ranks_per_node is None and uneven.num_nodes == 1 and uneven.mixed_nodes() == []
    with pytest.raises(ValueError, match=r"num_inference_ranks=16 does not fit a world of 16 ranks"):
        plan_topology(TopologyConfig(num_inference_ranks=16), 16, 0, local_world_size=8)  # INFERENCE_NODES = all nodes
