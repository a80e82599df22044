"""`slurmrl cluster up` on a GPU machine, on any machine: the devcluster's files rendered over a
fake /dev (nvidia0..3 beside nvidiactl and nvidia-uvm) and a fake cgroup v2 tree. Real GPUs are
split between the emulated nodes and mapped back to the machine's numbers in each task; --gpus auto
takes them where there are any; a shape needing more is refused in one line; cgroup v2 without
systemd gets slurmd's cgroup.conf; --no-accounting leaves slurmdbd out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm.devcluster import ClusterShape, DevCluster
from slurm.devcluster.daemons import DevclusterError
from slurm.devcluster.gpus import AUTO, FAKE, REAL, resolve
from slurm.devcluster.host import Host

GPUS = 4


def _gpu_machine(tmp_path: Path) -> Host:
    """A /dev of GPUS GPUs (links to /dev/null: device files, as slurmd wants) and a cgroup v2 mount."""
    dev, cgroup = tmp_path / "dev", tmp_path / "cgroup"
    dev.mkdir()
    cgroup.mkdir()
    for name in [f"nvidia{k}" for k in range(GPUS)] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]:
        (dev / name).symlink_to("/dev/null")
    (cgroup / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    return Host(dev=dev, cgroup=cgroup, sbin=tmp_path / "sbin")


def _task_env(prolog: Path, node: str, visible: str) -> str:
    """What the TaskProlog tells slurmstepd to set for a task on `node` that SLURM gave `visible`."""
    env = {"PATH": os.environ["PATH"], "SLURMD_NODENAME": node, "CUDA_VISIBLE_DEVICES": visible}
    return subprocess.run(["sh", str(prolog)], env=env, capture_output=True, text=True, timeout=10, check=True).stdout


def test_real_gpus_are_split_between_the_nodes_and_mapped_back_to_the_machines(tmp_path: Path) -> None:
    host = _gpu_machine(tmp_path)
    shape = ClusterShape(nodes=2, gpus_per_node=2, gpus=REAL, accounting=False, isolated=False)
    cluster = DevCluster(tmp_path / "dc", shape, host=host)
    cluster.write_files()
    etc = cluster.paths.etc
    assert (etc / "gres.conf").read_text().splitlines()[1:] == [
        "AutoDetect=off",
        f"NodeName=node1 Name=gpu File={host.dev}/nvidia[0-1]",
        f"NodeName=node2 Name=gpu File={host.dev}/nvidia[2-3]",
    ]
    conf = (etc / "slurm.conf").read_text()
    assert conf.count(" Gres=gpu:2 ") == 2 and "GresTypes=gpu" in conf
    assert f"TaskProlog={etc}/gpu_task_prolog.sh" in conf.splitlines()
    assert not list((cluster.paths.root / "dev").glob("*/nvidia*")), "no placeholder GPUs beside real ones"
    # SLURM numbers a node's GPUs from 0; the task prolog gives the task the machine's devices.
    prolog = etc / "gpu_task_prolog.sh"
    assert os.access(prolog, os.X_OK)
    assert _task_env(prolog, "node2", "1") == "export CUDA_DEVICE_ORDER=PCI_BUS_ID\nexport CUDA_VISIBLE_DEVICES=3\n"
    assert _task_env(prolog, "node2", "0,1").endswith("export CUDA_VISIBLE_DEVICES=2,3\n")
    assert _task_env(prolog, "node1", "1").endswith("export CUDA_VISIBLE_DEVICES=1\n")
    assert _task_env(prolog, "node1", "") == ""  # a step without GPUs keeps none
    # cgroup v2 and no systemd (the GPU machine): slurmd's own scope under system.slice.
    assert (etc / "cgroup.conf").read_text().splitlines()[1:] == ["CgroupPlugin=cgroup/v2", "IgnoreSystemd=yes"]
    assert (host.cgroup / "system.slice").is_dir()
    # No accounting: no slurmdbd or MariaDB, nothing that names them.
    assert "AccountingStorageType=accounting_storage/none" in conf.splitlines()
    assert "AccountingStorageHost" not in conf and not (etc / "slurmdbd.conf").exists()
    assert [d.name for d in cluster.daemons()] == ["munged", "slurmctld", "slurmd-node1", "slurmd-node2"]
    assert set(shape.all_ports()) == {"slurmctld", "slurmd-node1", "slurmd-node2"}


def test_fake_gpus_stay_as_they_were_on_a_cgroup_v1_machine(tmp_path: Path) -> None:
    host = Host(dev=tmp_path / "no-dev", cgroup=tmp_path / "cgroup-v1", sbin=tmp_path / "sbin")
    cluster = DevCluster(tmp_path / "dc", ClusterShape(nodes=2, gpus_per_node=2, isolated=False), host=host)
    cluster.write_files()
    fake = cluster.paths.root / "dev"
    assert (cluster.paths.etc / "gres.conf").read_text().splitlines()[2:] == [
        f"NodeName=node1 Name=gpu File={fake}/node1/nvidia[0-1]", f"NodeName=node2 Name=gpu File={fake}/node2/nvidia[0-1]"]
    assert os.readlink(fake / "node2" / "nvidia1") == "/dev/null"
    conf = (cluster.paths.etc / "slurm.conf").read_text()
    assert "TaskProlog" not in conf and "AccountingStorageType=accounting_storage/slurmdbd" in conf
    assert "CgroupPlugin" not in (cluster.paths.etc / "cgroup.conf").read_text()
    assert not (host.cgroup / "system.slice").exists()


def test_auto_takes_the_real_gpus_where_the_machine_has_some(tmp_path: Path) -> None:
    host = _gpu_machine(tmp_path)
    assert resolve(AUTO, 1, host.dev) == REAL
    assert resolve(AUTO, 1, tmp_path / "empty") == FAKE
    assert resolve(AUTO, 0, host.dev) == FAKE  # nodes that declare no GPUs: nothing to split
    assert resolve(FAKE, 1, host.dev) == FAKE and resolve(REAL, 1, tmp_path / "empty") == REAL


def test_more_real_gpus_than_the_machine_has_is_refused_in_one_line_before_anything(tmp_path: Path) -> None:
    host = _gpu_machine(tmp_path)
    cluster = DevCluster(tmp_path / "dc", ClusterShape(nodes=3, gpus_per_node=2, gpus=REAL, isolated=False), host=host)
    with pytest.raises(DevclusterError, match=r"--gpus real: 3 nodes x 2 GPUs \(--nodes x --gpus-per-node\) need 6, "
                                        rf"this machine has 4 \({host.dev}/nvidia0, .*\); lower --nodes"):
        cluster.up()
    assert not cluster.paths.root.exists()
    # From the command line (this machine's /dev), a shape no machine has: one line, exit 1, no files.
    root = tmp_path / "cli"
    result = subprocess.run([sys.executable, "-m", "slurm.devcluster", "up", "--dir", str(root), "--gpus", "real",
                             "--nodes", "64", "--gpus-per-node", "64", "--shared-loopback"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "--gpus real: 64 nodes x 64 GPUs (--nodes x --gpus-per-node) need 4096" in result.stderr
    assert not root.exists()
