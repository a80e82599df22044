"""Network faults on an isolated devcluster's node, for tests and people: cut (the node's link
down, its processes alive), slow (each packet to and from it delayed, some dropped) and heal
(undo both).

`cut` takes the bridge-side end of the node's veth down (netns.py): the node keeps its address
and routes, but nothing crosses the wire, as when a switch port dies (no reset reaches either
side; connections stall). `slow` would be `tc qdisc ... netem`, but the devcluster's kernel has
no sch_netem (and loads no modules): iptables rules in the node's namespace queue every packet
that crosses its veth, in and out, to NFQUEUE, where netdelay.py (run in that namespace) holds
each for the delay and drops the lost share. The queue is bypassed when no program reads it, so
a delayer that dies leaves the node fast, never cut.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil

from slurm.devcluster import netns
from slurm.devcluster.daemons import DevclusterError, wait_for, wait_gone

COMMAND_TIMEOUT_S = 20  # one `ip` or `iptables` command
DELAYER_START_S = 15  # netdelay binding its queue
DELAYER_STOP_S = 10
CHAIN = "srl-slow"  # the iptables chain `slow` adds in a node's namespace
REPO = Path(__file__).resolve().parents[2]


def plan_for(root: Path, node: str) -> netns.NetPlan:
    """The isolated cluster's plan at `root`, with `node` in it; a one-line error otherwise."""
    plan = netns.load_plan(root)
    if plan is None:
        raise DevclusterError(f"network faults need an isolated devcluster; none is up at {root} "
                              "(`slurmrl cluster up --isolated`)")
    if node not in plan.nodes:
        raise DevclusterError(f"no node {node!r} in the devcluster at {root} (nodes: {', '.join(plan.nodes)})")
    return plan


def cut(root: Path, node: str) -> None:
    """Take `node` off the network: its bridge-side veth end down."""
    plan = plan_for(root, node)
    _run("ip", "link", "set", _host_end(plan, node), "down")


def slow(root: Path, node: str, delay_ms: float, loss_pct: float) -> None:
    """Delay each packet to and from `node` by delay_ms and drop loss_pct percent of them."""
    if delay_ms < 0:
        raise DevclusterError(f"--delay-ms must be 0 or more, got {delay_ms:g}")
    if not 0 <= loss_pct <= 100:
        raise DevclusterError(f"--loss must be a percentage from 0 to 100, got {loss_pct:g}")
    plan = plan_for(root, node)
    if not shutil.which("iptables"):
        raise DevclusterError("`slow` needs the `iptables` program: apt-get install iptables")
    _unslow(root, plan, node)
    queue = plan.nodes.index(node) + 1
    log = _record(root, node).with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    with log.open("w") as out:
        proc = subprocess.Popen([*plan.enter(node), sys.executable, "-m", "slurm.devcluster.netdelay",
                                 "--queue", str(queue), "--delay-ms", f"{delay_ms:g}", "--loss", f"{loss_pct:g}"],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": pythonpath})
    _record(root, node).write_text(json.dumps({"pid": proc.pid, "delay_ms": delay_ms, "loss_pct": loss_pct}) + "\n")
    wait_for(lambda: "bound" in log.read_text() or proc.poll() is not None, DELAYER_START_S, f"netdelay on {node}")
    if proc.poll() is not None:
        _record(root, node).unlink()
        raise DevclusterError(f"netdelay on {node} exited {proc.returncode}: {log.read_text().strip()[-300:]}")
    end = _ns_end(plan, node)
    iptables = [*plan.enter(node), "iptables", "-w"]
    _run(*iptables, "-N", CHAIN)
    _run(*iptables, "-A", CHAIN, "-j", "NFQUEUE", "--queue-num", str(queue), "--queue-bypass")
    _run(*iptables, "-I", "INPUT", "-i", end, "-j", CHAIN)
    _run(*iptables, "-I", "OUTPUT", "-o", end, "-j", CHAIN)


def heal(root: Path, node: str) -> None:
    """Undo `cut` and `slow` on `node` (either, both or none may be in effect)."""
    plan = plan_for(root, node)
    _unslow(root, plan, node)
    _run("ip", "link", "set", _host_end(plan, node), "up")


def heal_all(root: Path) -> None:
    """Every node of the cluster at `root` healed (`down` calls it: no delayer outlives a cluster)."""
    plan = netns.load_plan(root)
    if plan is None:
        return
    links, namespaces = _run("ip", "-o", "link"), _run("ip", "netns", "list").split()
    for node in plan.nodes:  # only what is there: `down` also cleans up after a half-made network
        if f": {_host_end(plan, node)}@" in links and plan.namespace(node) in namespaces:
            heal(root, node)
        else:
            _stop_delayer(root, node)


def state(root: Path, node: str) -> str:
    """'healthy', 'cut', 'slow (delay D ms, loss P%)' or both: what is in effect on `node`."""
    plan = plan_for(root, node)
    flags = _run("ip", "-o", "link", "show", _host_end(plan, node)).split("<", 1)[1].split(">", 1)[0].split(",")
    faults = [] if "UP" in flags else ["cut"]
    if _record(root, node).exists():
        slowed = json.loads(_record(root, node).read_text())
        faults.append(f"slow (delay {slowed['delay_ms']:g}ms, loss {slowed['loss_pct']:g}%)")
    return ", ".join(faults) or "healthy"


def _unslow(root: Path, plan: netns.NetPlan, node: str) -> None:
    """Remove `slow`'s rules and stop its delayer, by the PID it recorded."""
    iptables = [*plan.enter(node), "iptables", "-w"]
    if shutil.which("iptables") and f"-N {CHAIN}" in _run(*iptables, "-S"):
        end = _ns_end(plan, node)
        _run(*iptables, "-D", "INPUT", "-i", end, "-j", CHAIN)
        _run(*iptables, "-D", "OUTPUT", "-o", end, "-j", CHAIN)
        _run(*iptables, "-F", CHAIN)
        _run(*iptables, "-X", CHAIN)
    _stop_delayer(root, node)


def _stop_delayer(root: Path, node: str) -> None:
    record = _record(root, node)
    if record.exists():
        try:
            proc = psutil.Process(json.loads(record.read_text())["pid"])
            if "slurm.devcluster.netdelay" in proc.cmdline():  # not a process that reused the PID
                proc.kill()
                wait_gone(proc, DELAYER_STOP_S)
        except psutil.NoSuchProcess:
            pass
        record.unlink()


def _record(root: Path, node: str) -> Path:
    return root / "faults" / f"{node}.slow.json"


def _host_end(plan: netns.NetPlan, node: str) -> str:
    return plan.veth(plan.nodes.index(node) + 1)[0]


def _ns_end(plan: netns.NetPlan, node: str) -> str:
    return plan.veth(plan.nodes.index(node) + 1)[1]


def _run(*argv: str) -> str:
    """Run `ip`, `iptables` (perhaps through nsenter); a failure is one line with what it said."""
    result = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if result.returncode != 0:
        said = "; ".join(line.strip() for line in result.stderr.splitlines() if line.strip())
        raise DevclusterError(f"`{' '.join(argv)}` failed: {said or f'exit {result.returncode}'}")
    return result.stdout
