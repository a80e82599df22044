"""An isolated devcluster's network: one network namespace per node on a private bridge.

The bridge (srl-<port_base>) holds the host side's address; each node's namespace
(srl-<port_base>-nodeK) has lo and one veth into the bridge with the node's own address. The
subnet is a 10.x.0.0/16 that overlaps no route the machine has; no default route or NAT is
added, so nothing in a namespace reaches past the bridge. Node names resolve through lines in
/etc/hosts that carry this cluster's marker (slurmd enters only the network namespace, so
its steps read the host's /etc/hosts).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from slurm.devcluster.daemons import DevclusterError, machine_lock

HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARK = "# slurmrl devcluster"  # ends each hosts line a cluster adds, before its bridge's name
NETNS_DIR = Path("/run/netns")  # where `ip netns add` pins each named namespace
# Second octets tried for 10.x.0.0/16, high ones first: private setups tend to use the low ones.
SUBNET_CANDIDATES = [*range(200, 255), *range(100, 200)]
IP_TIMEOUT_S = 20  # one `ip` command
NAMESPACES_REFUSED = "network namespaces are not allowed here"  # the refusal's words (tests fall back on them)
IP_MISSING = ("an isolated devcluster needs the `ip` program (iproute2): apt-get install iproute2, "
              "or run `slurmrl cluster up --shared-loopback`")


@dataclass(frozen=True)
class NetPlan:
    """The names and addresses of one isolated cluster's network."""

    port_base: int
    nodes: list[str]
    subnet: str  # "10.x.0.0/16"

    @property
    def bridge(self) -> str:
        return f"srl-{self.port_base}"

    @property
    def host_addr(self) -> str:
        """The bridge's address: where slurmctld listens for the nodes."""
        return str(ipaddress.ip_network(self.subnet).network_address + 1)

    def namespace(self, node: str) -> str:
        return f"srl-{self.port_base}-{node}"

    def enter(self, node: str) -> list[str]:
        """The argv prefix that runs a command in the node's network namespace."""
        return ["nsenter", f"--net={NETNS_DIR / self.namespace(node)}"]

    def veth(self, k: int) -> tuple[str, str]:
        """Host-side and namespace-side names of node k's (1-based) veth; at most 15 characters."""
        return f"srl-{self.port_base}-h{k}", f"srl-{self.port_base}-n{k}"

    def node_addr(self, node: str) -> str:
        k = self.nodes.index(node) + 1
        return str(ipaddress.ip_network(self.subnet).network_address + 256 + k)  # 10.x.1.k

    @property
    def marker(self) -> str:
        """The comment that ends each /etc/hosts line of this cluster."""
        return f"{HOSTS_MARK} {self.bridge}"

    def hosts_lines(self) -> list[str]:
        return [f"{self.node_addr(n)} {n} {self.marker}" for n in self.nodes]


def namespace_inodes(plan: NetPlan) -> set[int]:
    """The inode of each node's network namespace (what /proc/PID/ns/net of a process in it names)."""
    found = set()
    for node in plan.nodes:
        with contextlib.suppress(FileNotFoundError):
            found.add(os.stat(NETNS_DIR / plan.namespace(node)).st_ino)
    return found


def plan_file(root: Path) -> Path:
    return root / "netns.json"


def load_plan(root: Path) -> NetPlan | None:
    path = plan_file(root)
    return NetPlan(**json.loads(path.read_text())) if path.exists() else None


def choose_subnet() -> str:
    """The first 10.x.0.0/16 that overlaps no IPv4 route of the machine (`ip route`)."""
    # The default route is left out: it overlaps everything, and what it reaches is off this machine.
    destinations = [line.split()[0] for line in _ip("-4", "route").splitlines() if line.strip()]
    routes = [ipaddress.ip_network(d, strict=False) for d in destinations if d != "default"]
    for x in SUBNET_CANDIDATES:
        net = ipaddress.ip_network(f"10.{x}.0.0/16")
        if not any(net.overlaps(r) for r in routes):
            return str(net)
    raise DevclusterError("every 10.x.0.0/16 for the isolated devcluster overlaps a route of this machine (`ip route`)")


def set_up(root: Path, port_base: int, nodes: list[str]) -> NetPlan:
    """Create the bridge, namespaces, veths and hosts lines (again if partly there); all or nothing.
    One cluster at a time on the machine: two at once would choose the same free subnet, and each
    rewrite /etc/hosts from what it read before the other wrote."""
    with machine_lock("network"):
        old = load_plan(root)
        if old is not None and old.port_base == port_base and old.nodes == nodes and _is_up(old):
            return old
        if old is not None:
            _tear_down(root)
        plan = NetPlan(port_base, nodes, choose_subnet())
        _refuse_foreign_hosts_lines(plan)
        _add_namespace(plan.namespace(nodes[0]))  # alone: where namespaces are not allowed, nothing else is tried
        try:
            _create(plan)
        except DevclusterError:
            _remove(plan)
            raise
        root.mkdir(parents=True, exist_ok=True)
        plan_file(root).write_text(json.dumps(asdict(plan)) + "\n")
        return plan


def tear_down(root: Path) -> bool:
    """Remove what set_up made at `root` (one cluster at a time, as set_up). Returns whether there
    was anything."""
    with machine_lock("network"):
        return _tear_down(root)


def _tear_down(root: Path) -> bool:
    plan = load_plan(root)
    if plan is None:
        return False
    _remove(plan)
    plan_file(root).unlink()
    return True


def check_allowed() -> None:
    """Refuse in one line where this machine cannot make network namespaces: before `up` installs
    or starts anything. A probe namespace is made and removed."""
    probe = f"srl-probe-{os.getpid()}"
    _add_namespace(probe)
    _ip("netns", "delete", probe)


def _add_namespace(name: str) -> None:
    try:
        _ip("netns", "add", name)
    except DevclusterError as err:
        raise DevclusterError(f"{NAMESPACES_REFUSED} ({err}); "
                              "run `slurmrl cluster up --shared-loopback` (every node on 127.0.0.1)") from None


def _create(plan: NetPlan) -> None:
    """Everything but the first namespace, which set_up made."""
    prefix = ipaddress.ip_network(plan.subnet).prefixlen
    _ip("link", "add", plan.bridge, "type", "bridge")
    _ip("addr", "add", f"{plan.host_addr}/{prefix}", "dev", plan.bridge)
    _ip("link", "set", plan.bridge, "up")
    for k, node in enumerate(plan.nodes, 1):
        ns, (host_end, ns_end) = plan.namespace(node), plan.veth(k)
        if k > 1:
            _ip("netns", "add", ns)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        _ip("link", "set", ns_end, "netns", ns)
        _ip("link", "set", host_end, "master", plan.bridge)
        _ip("link", "set", host_end, "up")
        _ip("-n", ns, "addr", "add", f"{plan.node_addr(node)}/{prefix}", "dev", ns_end)
        _ip("-n", ns, "link", "set", ns_end, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
    _write_hosts([*_hosts_without(plan.marker), *plan.hosts_lines()])


def _remove(plan: NetPlan) -> None:
    """Remove every piece of `plan` that exists; a namespace whose processes live on is gone
    from `ip netns` at once and freed by the kernel when they exit."""
    _write_hosts(_hosts_without(plan.marker))
    links, namespaces = _names("link"), _names("netns")
    for k, node in enumerate(plan.nodes, 1):
        if plan.veth(k)[0] in links:
            _ip("link", "del", plan.veth(k)[0])  # takes its peer in the namespace with it
        if plan.namespace(node) in namespaces:
            _ip("netns", "del", plan.namespace(node))
    if plan.bridge in links:
        _ip("link", "del", plan.bridge)


def _is_up(plan: NetPlan) -> bool:
    links, namespaces = _names("link"), _names("netns")
    return (plan.bridge in links and all(plan.namespace(n) in namespaces for n in plan.nodes)
            and all(line in _hosts() for line in plan.hosts_lines()))


def _refuse_foreign_hosts_lines(plan: NetPlan) -> None:
    """Node names are the same in every devcluster: two isolated ones would fight over them."""
    for line in _hosts():
        fields = line.split("#")[0].split()
        if f"{HOSTS_MARK} " in line and plan.marker not in line and set(fields[1:]) & set(plan.nodes):
            raise DevclusterError(f"/etc/hosts already maps these node names for another isolated devcluster "
                                  f"({line.split('#')[1].strip()}); bring that one down first")


def _names(kind: str) -> set[str]:
    """Names of the host's links (`link`) or of the named namespaces (`netns`)."""
    if kind == "netns":
        return {line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()}
    return {line.split(":")[1].strip().split("@")[0] for line in _ip("-o", "link").splitlines() if line.strip()}


def _hosts() -> list[str]:
    return HOSTS_FILE.read_text().splitlines()


def _hosts_without(marker: str) -> list[str]:
    return [line for line in _hosts() if not line.endswith(marker)]


def _write_hosts(lines: list[str]) -> None:
    # In place, not by rename: /etc/hosts is often a bind mount (containers). Not emptied first either: a
    # process resolving a name meanwhile (gloo resolves the machine's own, CI saw `getaddrinfo` fail) would
    # find nothing. The machine's own lines come first and keep their place, so they are whole at every moment.
    data = ("\n".join(lines) + "\n").encode()
    if HOSTS_FILE.read_bytes() == data:
        return
    with HOSTS_FILE.open("r+b") as f:
        f.write(data)
        f.truncate()


def _ip(*args: str) -> str:
    if not shutil.which("ip"):
        raise DevclusterError(IP_MISSING)
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if result.returncode != 0:
        said = "; ".join(line.strip() for line in result.stderr.splitlines() if line.strip())
        raise DevclusterError(f"`ip {' '.join(args)}` failed: {said or f'exit {result.returncode}'}")
    return result.stdout
