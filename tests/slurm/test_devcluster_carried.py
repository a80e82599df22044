"""`slurmrl cluster up --debs DIR --no-accounting`: SLURM and munge from carried Debian packages
(where apt-get reaches no registry: the GPU machine), unpacked into a prefix and run from there.
Unit tests over packages built here, then one cluster brought up from the real packages
(scripts/fetch_slurm_debs.sh) with real-mode GPUs over a fake /dev: each node's step sees its own
device, and what slurmrl asks SLURM answers without the accounting."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobs.hetjob import HetInfoWatcher
from slurm.devcluster import ClusterShape, DevCluster, carried
from slurm.devcluster.daemons import DevclusterError, wait_for
from slurm.devcluster.gpus import REAL
from slurm.devcluster.host import Host
from supervisor.slurm_jobs import job_state
from supervisor.step_control import UNKNOWN_EXIT
from supervisor.steps import StepController

ROOT = Path(__file__).resolve().parents[2]
SLURM_FILES = ["usr/sbin/slurmd-wlm", "usr/sbin/slurmctld-wlm", "usr/sbin/slurmstepd-wlm", "usr/bin/sbatch",
               "usr/bin/srun", "usr/bin/squeue", "usr/bin/scontrol", "usr/bin/sinfo", "usr/bin/scancel",
               "usr/lib/x86_64-linux-gnu/slurm-wlm/libslurmfull.so"]
FETCH_S = 300  # scripts/fetch_slurm_debs.sh: about 5 MB
PORT_BASE, PREFIX = 18900, "deb"  # clear of the session's clusters (tests/conftest.py)
CLUSTER_UP_S = 60
SRUN_S = 60


def _deb(folder: Path, name: str, files: dict[str, str]) -> Path:
    """A Debian package holding `files` (path -> content), built with dpkg-deb."""
    tree = folder / f"{name}-tree"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN" / "control").write_text(f"Package: {name}\nVersion: 1.0\nArchitecture: all\n"
                                             "Maintainer: test <t@example.org>\nDescription: test\n")
    for path, content in files.items():
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_text(content)
    deb = folder / f"{name}_1.0_all.deb"
    subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(tree), str(deb)], check=True,
                   capture_output=True, timeout=60)
    return deb


@pytest.fixture
def debs(tmp_path: Path) -> Path:
    folder = tmp_path / "debs"
    folder.mkdir()
    _deb(tmp_path, "fake-slurm", {path: f"{path}\n" for path in SLURM_FILES}).rename(folder / "fake-slurm_1.0_all.deb")
    _deb(tmp_path, "fake-munge", {"usr/sbin/munged": "munged\n"}).rename(folder / "fake-munge_1.0_all.deb")
    return folder


def test_the_packages_are_unpacked_once_and_run_by_their_plain_names(debs: Path, tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    carried.unpack(debs, prefix, in_use=False)
    sbin = prefix / "usr" / "sbin"
    assert {name: os.readlink(sbin / name) for name in ("slurmd", "slurmctld", "slurmstepd")} == \
        {"slurmd": "slurmd-wlm", "slurmctld": "slurmctld-wlm", "slurmstepd": "slurmstepd-wlm"}
    programs = carried.SlurmPrograms(prefix)
    assert programs.daemon("slurmctld") == f"{sbin}/slurmctld" and programs.daemon("munged") == f"{sbin}/munged"
    lib, libs = prefix / "usr" / "lib" / "x86_64-linux-gnu", prefix / "lib" / "x86_64-linux-gnu"
    assert programs.plugin_dir == lib / "slurm-wlm"
    assert programs.env({"PATH": "/usr/bin"}) == {"PATH": f"{prefix}/usr/bin:/usr/bin",
                                                  "LD_LIBRARY_PATH": f"{libs}:{lib}:{lib}/slurm-wlm"}
    assert carried.env_script(Path("/c/slurm.conf"), programs).splitlines() == [
        "export SLURM_CONF=/c/slurm.conf", f"export PATH={prefix}/usr/bin${{PATH:+:$PATH}}",
        f"export LD_LIBRARY_PATH={libs}:{lib}:{lib}/slurm-wlm${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"]
    assert carried.SlurmPrograms().daemon("slurmd") == "slurmd" and carried.SlurmPrograms().env() == {}

    (sbin / "munged").write_text("kept\n")
    carried.unpack(debs, prefix, in_use=True)  # the same packages: nothing to do, even under running daemons
    assert (sbin / "munged").read_text() == "kept\n"
    _deb(tmp_path, "fake-extra", {"usr/share/doc/x": "x\n"}).rename(debs / "fake-extra_1.0_all.deb")
    with pytest.raises(DevclusterError, match="changed while the devcluster runs from them"):
        carried.unpack(debs, prefix, in_use=True)
    carried.unpack(debs, prefix, in_use=False)
    assert (sbin / "munged").read_text() == "munged\n" and (prefix / "usr/share/doc/x").exists()


def test_packages_that_miss_a_program_are_refused_naming_it(debs: Path, tmp_path: Path) -> None:
    (debs / "fake-slurm_1.0_all.deb").unlink()
    with pytest.raises(DevclusterError, match=r"the packages hold no usr/sbin/slurmd-wlm, .*fetch_slurm_debs.sh"):
        carried.unpack(debs, tmp_path / "prefix", in_use=False)
    with pytest.raises(DevclusterError, match="no .deb files there"):
        carried.unpack(tmp_path, tmp_path / "prefix2", in_use=False)


def test_slurmstepd_is_linked_where_slurmd_runs_it_and_another_slurms_is_left_alone(debs: Path,
                                                                                    tmp_path: Path) -> None:
    prefix, other = tmp_path / "dc" / "prefix", tmp_path / "old" / "prefix"
    carried.unpack(debs, prefix, in_use=False)
    host = Host(sbin=tmp_path / "sbin")
    carried.link_stepd(prefix, host)  # none there (the GPU machine)
    assert host.stepd.resolve() == (prefix / "usr/sbin/slurmstepd-wlm").resolve()
    host.stepd.unlink()
    host.stepd.symlink_to(other / "usr/sbin/slurmstepd")  # another devcluster's, gone since
    carried.link_stepd(prefix, host)
    assert os.readlink(host.stepd) == str(prefix / "usr/sbin/slurmstepd")
    host.stepd.unlink()
    host.stepd.write_bytes((prefix / "usr/sbin/slurmstepd-wlm").read_bytes())  # the same package, installed
    carried.link_stepd(prefix, host)
    assert not host.stepd.is_symlink()
    host.stepd.write_text("another SLURM's slurmstepd\n")
    with pytest.raises(DevclusterError, match="is another SLURM's slurmstepd"):
        carried.link_stepd(prefix, host)
    assert host.stepd.read_text() == "another SLURM's slurmstepd\n"


@pytest.mark.parametrize(("flags", "expected"), [
    (["--debs", "{tmp}/none", "--no-accounting"], "--debs {tmp}/none: no such folder; fetch the packages into it"),
    (["--debs", "{tmp}"], "the carried packages hold no slurmdbd or MariaDB; add --no-accounting"),
])
def test_bad_debs_flags_are_one_line_errors_and_write_nothing(tmp_path: Path, flags: list[str], expected: str) -> None:
    root = tmp_path / "dc"
    argv = [flag.format(tmp=tmp_path) for flag in flags]
    result = subprocess.run([sys.executable, "-m", "slurm.devcluster", "up", "--dir", str(root), "--shared-loopback",
                             *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert expected.format(tmp=tmp_path) in result.stderr
    assert not root.exists()


@pytest.fixture(scope="module")
def real_debs(slurm_programs) -> Path:
    """Debian's packages, as scripts/fetch_slurm_debs.sh fetches them (once: .debs/ is kept)."""
    fetched = subprocess.run(["bash", str(ROOT / "scripts" / "fetch_slurm_debs.sh")], capture_output=True, text=True,
                             timeout=FETCH_S)
    if fetched.returncode != 0:
        pytest.skip(f"apt-get download does not work here: {fetched.stderr.strip()[-300:]}")
    return ROOT / ".debs"


@pytest.fixture(scope="module")
def carried_cluster(real_debs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """Two nodes of one real GPU each, over a fake /dev of two, from the carried packages, no accounting."""
    tmp = tmp_path_factory.mktemp("carried")
    (tmp / "dev").mkdir()
    for k in range(2):
        (tmp / "dev" / f"nvidia{k}").symlink_to("/dev/null")
    shape = ClusterShape(nodes=2, gpus_per_node=1, gpus=REAL, accounting=False, debs=str(real_debs), isolated=False,
                         port_base=PORT_BASE, node_prefix=PREFIX)
    cluster = DevCluster(tmp / "dc", shape, host=Host(dev=tmp / "dev"))
    try:
        cluster.up(timeout_s=CLUSTER_UP_S)
    except DevclusterError as err:
        cluster.down()
        if "another SLURM's slurmstepd" in str(err):  # an installed SLURM of another version
            pytest.skip(str(err))
        raise
    yield cluster
    cluster.down()
    assert not cluster.running_daemons()


def _run(cluster: DevCluster, *argv: str) -> str:
    done = subprocess.run(argv, env={**os.environ, **cluster.client_env()}, capture_output=True, text=True,
                          timeout=SRUN_S)
    assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr}"
    return done.stdout


def test_a_cluster_from_the_carried_packages_gives_each_node_its_own_gpu(carried_cluster: DevCluster) -> None:
    cluster, prefix = carried_cluster, carried_cluster.paths.prefix
    assert [d.argv[0] for d in cluster.daemons()] == [f"{prefix}/usr/sbin/{name}" for name in
                                                      ("munged", "slurmctld", "slurmd", "slurmd")]
    assert _run(cluster, "sinfo", "-h", "-N", "-o", "%N %G").split() == ["deb1", "gpu:1", "deb2", "gpu:1"]
    seen = {node: _run(cluster, "srun", "-w", node, "--gres=gpu:1", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES").strip()
            for node in ("deb1", "deb2")}
    assert seen == {"deb1": "0", "deb2": "1"}
    which = _run(cluster, "sh", "-c", "command -v srun")
    assert which.strip() == f"{prefix}/usr/bin/srun"
    # the cgroup/v2 plugin slurmd loads (under cgroup v2) needs libdbus-1, which Debian 12 keeps in
    # the prefix's lib/, not usr/lib/: a GPU machine without dbus failed "Dlopen of plugin file failed"
    assert cluster.programs.plugin_dir is not None
    plugin = cluster.programs.plugin_dir / "cgroup_v2.so"
    linked = _run(cluster, "ldd", str(plugin))
    assert "not found" not in linked and f"{prefix}/lib/x86_64-linux-gnu/libdbus-1.so.3" in linked, linked


def test_slurmrl_asks_squeue_where_there_is_no_accounting(carried_cluster: DevCluster,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in carried_cluster.client_env().items():
        monkeypatch.setenv(name, value)
    job_id = _run(carried_cluster, "sbatch", "--parsable", "-w", "deb1", "--wrap", "srun true").strip()
    gone = subprocess.run(["sacct", "-j", job_id], capture_output=True, text=True, timeout=SRUN_S)
    assert gone.returncode != 0 and "accounting storage is disabled" in gone.stderr
    wait_for(lambda: _run(carried_cluster, "squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T").strip() == "COMPLETED",
             SRUN_S, f"job {job_id} to complete")
    # `slurmrl status` of a job its supervisor never wrote of; Submitit's job state.
    assert job_state(job_id, 10.0).state == "COMPLETED"
    watcher = HetInfoWatcher(delay_s=0)
    watcher.register_job(job_id)
    assert watcher.get_state(job_id, mode="force") == "COMPLETED" and watcher.is_done(job_id, mode="cache")
    # An adopted step that ended: no exit code will come, so none is waited for.
    began = time.monotonic()
    step = StepController(job_id, 10.0, exit_code_wait_s=30.0).ended("engine-0", f"{job_id}.0")
    assert step.proc is not None and step.proc.wait(10) == UNKNOWN_EXIT
    assert time.monotonic() - began < 5.0, "waited for an exit code the accounting cannot have"
