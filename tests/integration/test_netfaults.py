"""`slurmrl cluster cut|slow|heal NODE` on an isolated cluster's network (its namespaces, bridge
and hosts lines, without the SLURM daemons, which the faults do not touch): after a cut node2's
server is unreachable from node1 within a bound while it lives on, and reachable after heal;
after slow a TCP round trip takes at least the delay each way; on a cluster without namespaces
the commands refuse in one line. It needs no devcluster lock: it starts no SLURM daemon and
writes no /etc/hosts line."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from slurm.devcluster import faults, netns
from slurm.devcluster.daemons import DevclusterError, wait_for
from tests.integration.netfaults import CONNECT_TIMEOUT_S, connect_s, fault, in_node, node_addr, tcp_server
from tests.ports import free_port

pytestmark = [pytest.mark.integration]
PORT_BASE = 19200  # its own bridge name, clear of the other isolated tests' (19100, 19150)
NODES = ["node1", "node2"]
DELAY_MS = 200
HEAL_S = 10  # a healed link forwarding again (the bridge port comes back at once; ARP may need a retry)


@pytest.fixture
def net(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The network alone, its node names in a hosts file of its own: the machine's /etc/hosts,
    which the session devcluster's users read, is left alone (and its lines for that cluster's
    nodes are not copied: they would stand for another isolated cluster)."""
    root = tmp_path / "dc"
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(line for line in netns.HOSTS_FILE.read_text().splitlines(keepends=True)
                             if netns.HOSTS_MARK not in line))
    monkeypatch.setattr(netns, "HOSTS_FILE", hosts)
    try:
        netns.set_up(root, PORT_BASE, NODES)
    except DevclusterError as err:
        if netns.NAMESPACES_REFUSED in str(err) or str(err) == netns.IP_MISSING:
            pytest.skip(str(err))
        raise
    try:
        yield root
    finally:
        faults.heal_all(root)  # stops a delayer that a failed test left
        netns.tear_down(root)


def test_cut_slow_heal(net: Path) -> None:
    port, addr = free_port(), node_addr(net, "node2")
    with tcp_server(net, "node2", port) as server:
        healthy = connect_s(net, "node1", addr, port)
        assert healthy is not None and healthy < DELAY_MS / 1000

        assert fault(net, "cut", "node2") == "node2: cut"
        assert connect_s(net, "node1", addr, port) is None  # failed within CONNECT_TIMEOUT_S
        assert connect_s(net, "node2", addr, port) is not None  # node2 itself is fine: only its link is down
        assert server.is_running()

        assert fault(net, "heal", "node2") == "node2: healthy"
        wait_for(lambda: connect_s(net, "node1", addr, port) is not None, HEAL_S, "node2 reachable after heal")

        said = fault(net, "slow", "node2", "--delay-ms", str(DELAY_MS), "--loss", "5")
        assert said.startswith("node2: slow (") and "delay 200ms" in said and "loss 5%" in said
        slowed = connect_s(net, "node1", addr, port, timeout_s=CONNECT_TIMEOUT_S * 3)  # a lost SYN waits 1 s
        assert slowed is not None and slowed >= 2 * DELAY_MS / 1000  # the SYN and its answer, each delayed
        assert connect_s(net, "node2", addr, port) < DELAY_MS / 1000  # within node2: no wire, no delay

        fault(net, "cut", "node2")  # heal undoes both at once
        assert fault(net, "heal", "node2") == "node2: healthy"
        wait_for(lambda: (connect_s(net, "node1", addr, port) or 1.0) < DELAY_MS / 1000, HEAL_S,
                 "node2 fast again after heal")


def test_faults_need_an_isolated_cluster(tmp_path: Path, net: Path) -> None:
    for argv, error in ((["cut", "node1", "--dir", str(tmp_path / "none")], "need an isolated devcluster"),
                        (["slow", "node9", "--dir", str(net)], "no node 'node9'"),
                        (["slow", "node1", "--loss", "120", "--dir", str(net)], "--loss must be a percentage")):
        done = subprocess.run([sys.executable, "-m", "slurm.devcluster", *argv], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 1 and error in done.stderr and len(done.stderr.strip().splitlines()) == 1, done


def test_heal_all_stops_every_delayer(net: Path) -> None:
    """What `slurmrl cluster down` does first: no delayer outlives the cluster, no rule is left."""
    fault(net, "slow", "node1", "--delay-ms", "50")
    fault(net, "cut", "node2")
    delayer = psutil.Process(json.loads((net / "faults" / "node1.slow.json").read_text())["pid"])
    assert "slurm.devcluster.netdelay" in delayer.cmdline()
    faults.heal_all(net)
    assert not delayer.is_running() or delayer.status() == psutil.STATUS_ZOMBIE
    assert [faults.state(net, n) for n in NODES] == ["healthy", "healthy"]
    rules = subprocess.run([*in_node(net, "node1"), "iptables", "-S"], capture_output=True, text=True, check=True)
    assert faults.CHAIN not in rules.stdout
