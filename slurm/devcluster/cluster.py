"""Bring a real SLURM cluster up and down on loopback: munge, MariaDB and slurmdbd (unless
--no-accounting), slurmctld and one `slurmd -N nodeK` per emulated node, with the machine's GPUs
or placeholder files as gres; SLURM installed, or unpacked from carried packages (--debs).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
from pathlib import Path

import psutil

from slurm import env as slurm_env
from slurm.client import SlurmClient
from slurm.contact import SlurmContact
from slurm.devcluster import carried, faults, gpus, netns
from slurm.devcluster.accounting import Accounting
from slurm.devcluster.config import (
    ClusterPaths,
    ClusterShape,
    load_shape,
    render_slurm_conf,
    save_shape,
    write_private,
)
from slurm.devcluster.daemons import Daemon, DevclusterError, log_tail, port_open, wait_for, wait_gone
from slurm.devcluster.host import Host, render_cgroup_conf

STRAY_KILL_S = 10.0  # stray step processes dying after SIGKILL
SLURM_CALL_S = 30.0  # one sinfo/scontrol/scancel/squeue call to the devcluster


class DevCluster:
    """A devcluster rooted at one directory. `up` is idempotent; `down` stops what `up` started."""

    def __init__(self, root: Path, shape: ClusterShape | None = None, host: Host | None = None) -> None:
        """host: where this machine's GPUs, cgroups and slurmstepd are (tests hand in a fake tree)."""
        self.paths = ClusterPaths(Path(root).resolve())
        self.shape = shape or load_shape(self.paths) or ClusterShape()
        self.host = host or Host()
        self.programs = carried.SlurmPrograms(self.paths.prefix if self.shape.debs else None)
        self._set_env()
        self.accounting = Accounting(self.paths, self.shape, self._daemon, self.env) if self.shape.accounting else None
        self.net = netns.load_plan(self.paths.root) if self.shape.isolated else None

    def _set_env(self) -> None:
        """The environment of the daemons and of SLURM's programs: SLURM_CONF, and the carried
        packages' programs and libraries once they are unpacked."""
        unpacked = self.programs.prefix is not None and carried.unpacked(self.programs.prefix)
        self.env = {slurm_env.CONF: str(self.paths.slurm_conf), **(self.programs.env() if unpacked else {})}
        # Its own record of SLURM's answers: the devcluster's calls say nothing of a job's SLURM.
        self.slurm = SlurmClient(SLURM_CALL_S, env=self.env, contact=SlurmContact())

    # ---- daemons -------------------------------------------------------------------------
    def _daemon(self, name: str, argv: list[str]) -> Daemon:
        return Daemon(name, argv, self.paths.pids / f"{name}.pid", self.paths.log(name), self.env)

    def client_env(self) -> dict[str, str]:
        """What to add to an environment to point SLURM's programs (sbatch, srun, slurmrl) at this
        cluster: SLURM_CONF, and with --debs PATH and LD_LIBRARY_PATH (also in env.sh)."""
        return dict(self.env)

    def munged(self) -> Daemon:
        p = self.paths
        return self._daemon("munged", [
            self.programs.daemon("munged"), "--foreground", "--force", f"--socket={p.munge_socket}",
            f"--key-file={p.munge_key}", f"--pid-file={p.slurm_run}/munged.pid",
            f"--log-file={p.logs}/munged-internal.log", f"--seed-file={p.state}/munge.seed",
        ])

    def slurmctld(self) -> Daemon:
        return self._daemon("slurmctld", [self.programs.daemon("slurmctld"), "-D"])

    def slurmd(self, node: str) -> Daemon:
        # nsenter enters only the network namespace (`ip netns exec` also remounts /sys, hiding the
        # cgroup mount slurmd needs) and execs slurmd in place: the PID recorded is slurmd's.
        inside = ["nsenter", f"--net={netns.NETNS_DIR / self.net.namespace(node)}"] if self.net else []
        return self._daemon(f"slurmd-{node}", [*inside, self.programs.daemon("slurmd"), "-D", "-N", node])

    def daemons(self) -> list[Daemon]:
        """Every daemon, in start order."""
        nodes = [self.slurmd(n) for n in self.shape.node_names]
        accounting = self.accounting.daemons() if self.accounting else []
        return [self.munged(), *accounting, self.slurmctld(), *nodes]

    def running_daemons(self) -> list[Daemon]:
        return [d for d in self.daemons() if d.is_running()]

    def gpu_devices(self) -> dict[str, list[Path]]:
        """Node -> the GPU device files it declares (gres.conf); DevclusterError for a shape that
        needs more real GPUs than the machine has."""
        return gpus.assign(self.shape.gpus, self.shape.node_names, self.shape.gpus_per_node, self.host.dev,
                           self.paths.fake_gpu_dir)

    # ---- up ------------------------------------------------------------------------------
    def up(self, timeout_s: float = 90.0) -> None:
        self._refuse_reshape_while_running()
        self.gpu_devices()  # first: a shape that does not fit is refused before anything starts
        running = bool(self.running_daemons())
        if self.shape.debs:
            carried.unpack(Path(self.shape.debs), self.paths.prefix, in_use=running)
            carried.link_stepd(self.paths.prefix, self.host)
            self._set_env()
        if not running:
            self._check_ports_free()
        if self.shape.isolated:  # before the files: a machine without namespaces is refused before anything starts
            self.net = netns.set_up(self.paths.root, self.shape.port_base, self.shape.node_names)
        self.write_files()
        self._start_munge()
        if self.accounting is not None:
            # Past every job id the accounting holds (Accounting._first_job_id says why).
            self.paths.slurm_conf.write_text(self._slurm_conf(self.accounting.start(timeout_s)))
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

    def write_files(self) -> None:
        """Every file under --dir the daemons read (configs, keys, fake GPUs), and cluster.json."""
        p, shape, devices = self.paths, self.shape, self.gpu_devices()
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
        if shape.gpus == gpus.FAKE:
            for gpu in (gpu for files in devices.values() for gpu in files):
                # slurmd wants each GPU file to be a device: a link to /dev/null is one.
                gpu.parent.mkdir(parents=True, exist_ok=True)
                if not gpu.is_symlink():
                    gpu.symlink_to("/dev/null")
        if self.host.cgroup_v2:
            (self.host.cgroup / "system.slice").mkdir(exist_ok=True)  # host.render_cgroup_conf says why
        if not p.munge_key.exists():
            write_private(p.munge_key, secrets.token_bytes(1024))
        p.slurm_conf.write_text(self._slurm_conf())
        p.gres_conf.write_text(gpus.render_gres_conf(shape.gpus, devices))
        if shape.gpus == gpus.REAL:
            p.gpu_task_prolog.write_text(gpus.render_task_prolog(devices))
            p.gpu_task_prolog.chmod(0o755)
        p.cgroup_conf.write_text(render_cgroup_conf(self.host.cgroup_v2))
        p.env_script.write_text(carried.env_script(p.slurm_conf, self.programs))
        if self.accounting is not None:
            self.accounting.write_files()
        save_shape(p, shape)

    def _start_munge(self) -> None:
        daemon = self.munged()
        daemon.start()
        wait_for(lambda: self.paths.munge_socket.exists() or not daemon.is_running(), 15, "munged's socket")
        daemon.check_alive()

    def _slurm_conf(self, first_job_id: int = 1) -> str:
        plugin_dir = self.programs.plugin_dir
        if self.net is None:
            return render_slurm_conf(self.paths, self.shape, first_job_id, plugin_dir=plugin_dir)
        return render_slurm_conf(self.paths, self.shape, first_job_id, ctld_addr=self.net.host_addr,
                                 node_addrs={n: self.net.node_addr(n) for n in self.shape.node_names},
                                 plugin_dir=plugin_dir)

    def _start_slurmctld(self, timeout_s: float) -> None:
        daemon = self.slurmctld()
        daemon.start()
        addr = self.net.host_addr if self.net else "127.0.0.1"
        wait_for(lambda: port_open(addr, self.shape.slurmctld_port) or not daemon.is_running(), timeout_s, "slurmctld")
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
        shape = self.shape
        lines = [f"devcluster at {self.paths.root} ({shape.nodes} nodes, "
                 f"{shape.gpus_per_node} {shape.gpus} GPUs and {shape.cpus_per_node} CPUs each; "
                 f"{'SLURM from ' + shape.debs if shape.debs else 'SLURM installed'}, "
                 f"{'with' if shape.accounting else 'no'} accounting)", "", "daemons:"]
        if shape.gpus == gpus.REAL:
            with contextlib.suppress(DevclusterError):  # the machine's devices changed since `up`
                lines[1:1] = ["gpus: " + ", ".join(f"{node} {' '.join(map(str, files))}"
                                                   for node, files in self.gpu_devices().items())]
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
        lines += ["", f"to use it from a shell (or: source {self.paths.env_script}):",
                  *(f"  {line}" for line in carried.env_script(self.paths.slurm_conf, self.programs).splitlines())]
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
