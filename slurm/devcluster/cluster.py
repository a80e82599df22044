"""Bring a real SLURM cluster up and down on loopback: munge, MariaDB, slurmdbd, slurmctld and
one `slurmd -N nodeK` per emulated node, each with placeholder GPU files as gres.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
from pathlib import Path

import psutil

from slurm import env as slurm_env
from slurm.client import SlurmClient
from slurm.contact import SlurmContact
from slurm.devcluster import faults, netns
from slurm.devcluster.config import (
    ACCOUNTING_DB,
    CLUSTER_NAME,
    ClusterPaths,
    ClusterShape,
    load_shape,
    render_gres_conf,
    render_slurm_conf,
    render_slurmdbd_conf,
    save_shape,
)
from slurm.devcluster.daemons import Daemon, DevclusterError, log_tail, machine_lock, wait_for, wait_gone

APT_PACKAGES = ["slurm-wlm", "slurmdbd", "munge", "mariadb-server", "mariadb-client"]
REQUIRED_PROGRAMS = ["munged", "mariadbd", "mariadb-install-db", "mariadb", "slurmdbd", "slurmctld",
                     "slurmd", "sbatch", "srun", "sacct", "sacctmgr", "sinfo", "scontrol", "scancel"]
STRAY_KILL_S = 10.0  # stray step processes dying after SIGKILL
SLURM_CALL_S = 30.0  # one sinfo/scontrol/scancel/squeue/sacctmgr call to the devcluster


def ensure_installed() -> None:
    """apt-get install SLURM, munge and MariaDB if any of their programs is missing. One caller at
    a time (apt-get refuses a second while one runs): the next finds them installed."""
    if all(shutil.which(p) for p in REQUIRED_PROGRAMS):
        return
    with machine_lock("install"):
        if not all(shutil.which(p) for p in REQUIRED_PROGRAMS):  # else another caller installed them meanwhile
            _apt_get_install()
    missing = [p for p in REQUIRED_PROGRAMS if not shutil.which(p)]
    if missing:
        raise DevclusterError(f"installed {' '.join(APT_PACKAGES)} but still missing: {', '.join(missing)}")


def _apt_get_install() -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *APT_PACKAGES]):
        result = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if result.returncode != 0:
            raise DevclusterError(f"`{' '.join(argv)}` failed ({result.returncode}):\n{result.stderr[-2000:]}")


class DevCluster:
    """A devcluster rooted at one directory. `up` is idempotent; `down` stops what `up` started."""

    def __init__(self, root: Path, shape: ClusterShape | None = None) -> None:
        self.paths = ClusterPaths(Path(root).resolve())
        self.shape = shape or load_shape(self.paths) or ClusterShape()
        self.env = {slurm_env.CONF: str(self.paths.slurm_conf)}
        # Its own record of SLURM's answers: the devcluster's calls say nothing of a job's SLURM.
        self.slurm = SlurmClient(SLURM_CALL_S, env=self.env, contact=SlurmContact())
        self.net = netns.load_plan(self.paths.root) if self.shape.isolated else None

    # ---- daemons -------------------------------------------------------------------------
    def _daemon(self, name: str, argv: list[str]) -> Daemon:
        return Daemon(name, argv, self.paths.pids / f"{name}.pid", self.paths.log(name), self.env)

    def munged(self) -> Daemon:
        p = self.paths
        return self._daemon("munged", [
            "munged", "--foreground", "--force", f"--socket={p.munge_socket}", f"--key-file={p.munge_key}",
            f"--pid-file={p.slurm_run}/munged.pid", f"--log-file={p.logs}/munged-internal.log",
            f"--seed-file={p.state}/munge.seed",
        ])

    def mariadbd(self) -> Daemon:
        p = self.paths
        return self._daemon("mariadbd", [
            "mariadbd", "--no-defaults", f"--datadir={p.mariadb_data}", f"--socket={p.mariadb_socket}",
            f"--port={self.shape.mariadb_port}", "--bind-address=127.0.0.1", "--skip-name-resolve",
            # As root, like every devcluster daemon: --dir may sit below a directory other users cannot enter.
            f"--pid-file={p.mariadb_socket.parent}/mariadbd.pid", "--user=root",
            "--innodb-buffer-pool-size=64M", "--skip-log-bin",
        ])

    def slurmdbd(self) -> Daemon:
        return self._daemon("slurmdbd", ["slurmdbd", "-D"])

    def slurmctld(self) -> Daemon:
        return self._daemon("slurmctld", ["slurmctld", "-D"])

    def slurmd(self, node: str) -> Daemon:
        # nsenter enters only the network namespace (`ip netns exec` also remounts /sys, hiding the
        # cgroup mount slurmd needs) and execs slurmd in place: the PID recorded is slurmd's.
        inside = ["nsenter", f"--net={netns.NETNS_DIR / self.net.namespace(node)}"] if self.net else []
        return self._daemon(f"slurmd-{node}", [*inside, "slurmd", "-D", "-N", node])

    def daemons(self) -> list[Daemon]:
        """Every daemon, in start order."""
        nodes = [self.slurmd(n) for n in self.shape.node_names]
        return [self.munged(), self.mariadbd(), self.slurmdbd(), self.slurmctld(), *nodes]

    def running_daemons(self) -> list[Daemon]:
        return [d for d in self.daemons() if d.is_running()]

    # ---- up ------------------------------------------------------------------------------
    def up(self, timeout_s: float = 90.0) -> None:
        self._refuse_reshape_while_running()
        if not self.running_daemons():
            self._check_ports_free()
        if self.shape.isolated:  # first: a machine without namespaces is refused before anything starts
            self.net = netns.set_up(self.paths.root, self.shape.port_base, self.shape.node_names)
        self._write_files()
        self._start_munge()
        self._start_mariadb(timeout_s)
        self._start_slurmdbd(timeout_s)
        self._continue_job_ids()
        self._start_slurmctld(timeout_s)
        for node in self.shape.node_names:
            self.slurmd(node).start()
        self.wait_nodes_idle(timeout_s)

    def _refuse_reshape_while_running(self) -> None:
        saved = load_shape(self.paths)
        if saved is not None and saved != self.shape and self.running_daemons():
            raise DevclusterError(
                f"a devcluster with a different shape ({saved.nodes} nodes, {saved.gpus_per_node} GPUs each) "
                f"is running at {self.paths.root}; run `slurmrl cluster down --dir {self.paths.root}` first"
            )

    def _check_ports_free(self) -> None:
        for name, port in self.shape.all_ports().items():
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    raise DevclusterError(
                        f"port {port} (for {name}) is in use by another program; pick other ports with --port-base"
                    ) from None

    def _write_files(self) -> None:
        p, shape = self.paths, self.shape
        saved = load_shape(p)
        for d in (p.root, p.etc, p.logs, p.pids, p.slurm_run, p.state, p.munge_socket.parent):
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o755)
        if saved is not None and saved != shape:
            # Nodes changed: slurmctld's saved node and job state no longer applies.
            shutil.rmtree(p.state / "slurmctld", ignore_errors=True)
        (p.state / "slurmctld").mkdir(exist_ok=True)
        for node in shape.node_names:
            (p.state / f"slurmd-{node}").mkdir(exist_ok=True)
            gpu_dir = p.fake_gpu_dir(node)
            gpu_dir.mkdir(parents=True, exist_ok=True)
            for i in range(shape.gpus_per_node):
                # slurmd wants each GPU file to be a device: a link to /dev/null is one.
                gpu = gpu_dir / f"nvidia{i}"
                if not gpu.is_symlink():
                    gpu.symlink_to("/dev/null")
        if not p.munge_key.exists():
            _write_private(p.munge_key, secrets.token_bytes(1024))
        if not p.db_password_file.exists():
            _write_private(p.db_password_file, secrets.token_hex(16).encode())
        p.slurm_conf.write_text(self._slurm_conf())
        p.gres_conf.write_text(render_gres_conf(p, shape))
        _write_private(p.slurmdbd_conf, render_slurmdbd_conf(p, shape, self._db_password()).encode())
        save_shape(p, shape)

    def _db_password(self) -> str:
        return self.paths.db_password_file.read_text().strip()

    def _start_munge(self) -> None:
        daemon = self.munged()
        daemon.start()
        wait_for(lambda: self.paths.munge_socket.exists() or not daemon.is_running(), 15, "munged's socket")
        daemon.check_alive()

    def _start_mariadb(self, timeout_s: float) -> None:
        p = self.paths
        if not (p.mariadb_data / "mysql").exists():
            p.mariadb_data.mkdir(parents=True, exist_ok=True)
            _run(["mariadb-install-db", "--no-defaults", f"--datadir={p.mariadb_data}", "--user=root",
                  "--auth-root-authentication-method=socket", "--skip-test-db"], "initialising MariaDB")
        p.mariadb_socket.parent.mkdir(parents=True, exist_ok=True)
        daemon = self.mariadbd()
        daemon.start()
        wait_for(lambda: p.mariadb_socket.exists() or not daemon.is_running(), timeout_s, "MariaDB's socket")
        daemon.check_alive()
        password = self._db_password()
        sql = (
            f"CREATE DATABASE IF NOT EXISTS {ACCOUNTING_DB}; "
            f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}'; "
            f"ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}'; "
            f"GRANT ALL ON {ACCOUNTING_DB}.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;"
        )
        # The SQL goes through stdin so the password never shows in a process list.
        _run(["mariadb", "--no-defaults", f"--socket={p.mariadb_socket}", "-u", "root"],
             "creating the accounting database", stdin=sql)

    def _start_slurmdbd(self, timeout_s: float) -> None:
        daemon = self.slurmdbd()
        daemon.start()
        wait_for(lambda: _port_open("127.0.0.1", self.shape.slurmdbd_port) or not daemon.is_running(), timeout_s,
                 "slurmdbd")
        daemon.check_alive()
        clusters = self._sacctmgr(["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"], timeout_s)
        if CLUSTER_NAME not in clusters.split():
            self._sacctmgr(["sacctmgr", "-i", "add", "cluster", CLUSTER_NAME], timeout_s)

    def _continue_job_ids(self) -> None:
        """Start job ids past the accounting's highest. slurmctld's own state can be gone (a
        reshape drops it) while MariaDB keeps the old jobs: ids would start at 1 again, and
        `sacct -j N` would show an old job N beside the new one. Read from the table itself:
        sacct's time window leaves out a job cancelled before it started."""
        highest = _run(["mariadb", "--no-defaults", f"--socket={self.paths.mariadb_socket}", "-u", "root", "-N", "-B"],
                       "reading the highest job id in the accounting",
                       stdin=f"SELECT COALESCE(MAX(id_job), 0) FROM {ACCOUNTING_DB}.`{CLUSTER_NAME}_job_table`;")
        first_job_id = int(highest.strip()) + 1
        self.paths.slurm_conf.write_text(self._slurm_conf(first_job_id))

    def _slurm_conf(self, first_job_id: int = 1) -> str:
        if self.net is None:
            return render_slurm_conf(self.paths, self.shape, first_job_id)
        return render_slurm_conf(self.paths, self.shape, first_job_id, ctld_addr=self.net.host_addr,
                                 node_addrs={n: self.net.node_addr(n) for n in self.shape.node_names})

    def _start_slurmctld(self, timeout_s: float) -> None:
        daemon = self.slurmctld()
        daemon.start()
        addr = self.net.host_addr if self.net else "127.0.0.1"
        wait_for(lambda: _port_open(addr, self.shape.slurmctld_port) or not daemon.is_running(), timeout_s, "slurmctld")
        daemon.check_alive()

    def wait_nodes_idle(self, timeout_s: float) -> None:
        def ready() -> bool:
            for d in self.daemons():
                d.check_alive()
            states = self.node_states()
            return len(states) == self.shape.nodes and all(s in ("idle", "mix", "alloc") for s in states.values())

        try:
            wait_for(ready, timeout_s, f"{self.shape.nodes} nodes to be idle", interval_s=0.5)
        except TimeoutError as err:
            daemon_logs = [self.paths.log("slurmctld"),
                           *(self.paths.logs / f"slurmd-{n}.log" for n in self.shape.node_names)]
            logs = "\n".join(f"  {path}:\n{log_tail(path, 8)}" for path in daemon_logs)
            raise DevclusterError(f"{err}; node states now {self.node_states()}. Daemon logs:\n{logs}") from None

    # ---- node failures (for tests) -------------------------------------------------------
    def kill_slurmd(self, node: str) -> None:
        """SIGKILL one node's slurmd, as when the node dies. Its job steps' processes live on (on a
        devcluster every node is this host): a test kills those apart."""
        proc = self.slurmd(node).process()
        if proc is None:
            raise DevclusterError(f"the slurmd of {node} is not running")
        proc.kill()
        wait_gone(proc, 10)

    def revive_slurmd(self, node: str, timeout_s: float = 60.0) -> None:
        """Start a node's slurmd again and wait until the node is back in service (RESUMEd if SLURM
        left it DOWN or drained once it answers again)."""
        self.slurmd(node).start()
        self.back_in_service([node], timeout_s)

    def back_in_service(self, nodes: list[str], timeout_s: float) -> None:
        """Wait until every one of `nodes` is in service: one SLURM set DOWN while it did not
        answer (its slurmd killed, its link cut) and that answers again is RESUMEd."""
        def in_service() -> bool:
            states = self.node_states()
            for node in nodes:
                if states.get(node, "") in ("down", "drain", "drng"):  # answering (no '*'), not in service
                    self.slurm.call("scontrol", "update", f"NodeName={node}", "State=RESUME")
            return all(states.get(node) in ("idle", "mix", "alloc") for node in nodes)

        wait_for(in_service, timeout_s, f"{', '.join(nodes)} back in service", interval_s=0.5)

    # ---- status and down -----------------------------------------------------------------
    def node_states(self) -> dict[str, str]:
        """Node name -> SLURM state (idle, mix, alloc, down*, ...), or {} if slurmctld does not answer."""
        result = self.slurm.call("sinfo", "-h", "-N", "-o", "%N %t")
        if not result.ok:
            return {}
        return dict(line.split() for line in result.stdout.splitlines() if line.strip())

    def status(self) -> str:
        lines = [f"devcluster at {self.paths.root} ({self.shape.nodes} nodes, "
                 f"{self.shape.gpus_per_node} GPUs and {self.shape.cpus_per_node} CPUs each)", "", "daemons:"]
        if self.net:
            lines[1:1] = [f"isolated: bridge {self.net.bridge} at {self.net.host_addr}, "
                          + ", ".join(f"{n} {self.net.node_addr(n)}" for n in self.shape.node_names)]
        for d in self.daemons():
            proc = d.process()
            lines.append(f"  {d.name:<16} {'running, pid ' + str(proc.pid) if proc else 'stopped'}")
        if self.slurmctld().is_running():
            for title, args in (("nodes", ("-N", "-o", "%N %P %t %c %G")), ("partitions", ("-o", "%P %a %l %D %N"))):
                result = self.slurm.call("sinfo", *args)
                lines += ["", f"{title}:", *("  " + row for row in result.stdout.splitlines())]
        lines += ["", "to use it from a shell:", f"  {self.paths.env_line()}"]
        return "\n".join(lines)

    def down(self) -> list[str]:
        """Cancel every job, stop the daemons in reverse start order, then remove an isolated
        cluster's network. Returns what was stopped."""
        faults.heal_all(self.paths.root)  # first: slurmctld must reach a cut node to end its steps
        if self.slurmctld().is_running():
            self.slurm.call("scancel", "--full", "--user", "root")
            try:
                wait_for(lambda: not self._squeue_job_ids().strip(), 30, "jobs to end")
            except (TimeoutError, DevclusterError):
                pass  # the daemons are stopped below either way
        stopped = [d.name for d in reversed(self.daemons()) if d.stop()]
        strays = self._stop_stray_steps()
        return stopped + ([f"{strays} stray step processes"] if strays else []) + (
            ["network namespaces"] if netns.tear_down(self.paths.root) else [])

    def _stop_stray_steps(self) -> int:
        """SIGKILL what is left of steps the jobs' end did not reach (a node cut off when they were
        cancelled keeps its slurmstepd and tasks past its slurmd). Isolated: every process still in
        a node's network namespace (slurmd is stopped by now). Shared loopback: every slurmstepd
        whose environment names this cluster's SLURM_CONF, with its process tree (a slurmstepd's
        process title may overwrite what /proc shows of its environment: namespaces are surer).
        Returns how many processes were killed."""
        namespaces = netns.namespace_inodes(self.net) if self.net else set()
        conf = str(self.paths.slurm_conf)
        stray: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter(["name"]):
            with contextlib.suppress(psutil.Error, OSError):
                if namespaces and os.stat(f"/proc/{proc.pid}/ns/net").st_ino in namespaces:
                    stray[proc.pid] = proc
                elif proc.info["name"] == "slurmstepd" and proc.environ().get(slurm_env.CONF) == conf:
                    stray |= {p.pid: p for p in (proc, *proc.children(recursive=True))}
        for proc in stray.values():
            with contextlib.suppress(psutil.Error):
                proc.kill()
        _, alive = psutil.wait_procs(list(stray.values()), timeout=STRAY_KILL_S)
        if alive:
            raise DevclusterError(f"step processes {[p.pid for p in alive]} outlived SIGKILL by {STRAY_KILL_S} s")
        return len(stray)

    def _squeue_job_ids(self) -> str:
        reply = self.slurm.call("squeue", "-h", "-o", "%i")
        if not reply.ok:
            raise DevclusterError(f"squeue failed: {reply.why or reply.stderr.strip()}")
        return reply.stdout

    def _sacctmgr(self, argv: list[str], timeout_s: float) -> str:
        """A call of sacctmgr (the accounting's admin tool, not a SLURM client the client runs)."""
        result = subprocess.run(argv, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise DevclusterError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout


def _write_private(path: Path, data: bytes) -> None:
    """Write a file readable by its owner only, without a window where it is world-readable."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    path.chmod(0o600)


def _run(argv: list[str], doing: str, stdin: str = "") -> str:
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise DevclusterError(f"{doing} failed: `{argv[0]}` exited {result.returncode}:\n{result.stderr[-2000:]}")
    return result.stdout


def _port_open(addr: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((addr, port)) == 0
