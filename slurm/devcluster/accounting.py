"""The devcluster's accounting: MariaDB and slurmdbd, which record every job and step for sacct.
A cluster brought up with --no-accounting has neither (accounting_storage/none)."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Callable

from slurm.devcluster.config import (
    ACCOUNTING_DB,
    CLUSTER_NAME,
    ClusterPaths,
    ClusterShape,
    render_slurmdbd_conf,
    write_private,
)
from slurm.devcluster.daemons import Daemon, DevclusterError, port_open, wait_for

SQL_CALL_S = 120.0  # one mariadb-install-db or mariadb client call


class Accounting:
    """MariaDB and slurmdbd of one devcluster. `daemon(name, argv)` makes a Daemon with the
    cluster's PID file, log and environment; `env` is SLURM's (SLURM_CONF) for sacctmgr."""

    def __init__(self, paths: ClusterPaths, shape: ClusterShape, daemon: Callable[[str, list[str]], Daemon],
                 env: dict[str, str]) -> None:
        self.paths, self.shape, self._daemon, self.env = paths, shape, daemon, env

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

    def daemons(self) -> list[Daemon]:
        """In start order."""
        return [self.mariadbd(), self.slurmdbd()]

    def write_files(self) -> None:
        p = self.paths
        if not p.db_password_file.exists():
            write_private(p.db_password_file, secrets.token_hex(16).encode())
        write_private(p.slurmdbd_conf, render_slurmdbd_conf(p, self.shape, self._db_password()).encode())

    def start(self, timeout_s: float) -> int:
        """Start MariaDB and slurmdbd, register the cluster; the first job id to give (FirstJobId)."""
        self._start_mariadb(timeout_s)
        self._start_slurmdbd(timeout_s)
        return self._first_job_id()

    def _db_password(self) -> str:
        return self.paths.db_password_file.read_text().strip()

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
        wait_for(lambda: port_open("127.0.0.1", self.shape.slurmdbd_port) or not daemon.is_running(), timeout_s,
                 "slurmdbd")
        daemon.check_alive()
        clusters = self._sacctmgr(["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"], timeout_s)
        if CLUSTER_NAME not in clusters.split():
            self._sacctmgr(["sacctmgr", "-i", "add", "cluster", CLUSTER_NAME], timeout_s)

    def _first_job_id(self) -> int:
        """Past the accounting's highest job id. slurmctld's own state can be gone (a reshape drops
        it) while MariaDB keeps the old jobs: ids would start at 1 again, and `sacct -j N` would show
        an old job N beside the new one. Read from the table itself: sacct's time window leaves out
        a job cancelled before it started."""
        highest = _run(["mariadb", "--no-defaults", f"--socket={self.paths.mariadb_socket}", "-u", "root", "-N", "-B"],
                       "reading the highest job id in the accounting",
                       stdin=f"SELECT COALESCE(MAX(id_job), 0) FROM {ACCOUNTING_DB}.`{CLUSTER_NAME}_job_table`;")
        return int(highest.strip()) + 1

    def _sacctmgr(self, argv: list[str], timeout_s: float) -> str:
        """A call of sacctmgr (the accounting's admin tool, not a SLURM client the client runs)."""
        result = subprocess.run(argv, env={**os.environ, **self.env}, capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise DevclusterError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout


def _run(argv: list[str], doing: str, stdin: str = "") -> str:
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=SQL_CALL_S)
    if result.returncode != 0:
        raise DevclusterError(f"{doing} failed: `{argv[0]}` exited {result.returncode}:\n{result.stderr[-2000:]}")
    return result.stdout
