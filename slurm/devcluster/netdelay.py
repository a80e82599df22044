"""`python -m slurm.devcluster.netdelay --queue N --delay-ms D --loss P`: hold every packet that
netfilter queues to NFQUEUE N for D ms, then let it through; drop P percent of them.

This is `slurmrl cluster slow`'s netem for kernels built without sch_netem (the devcluster's VM
has none and loads no modules): iptables rules in a node's namespace queue the packets that
cross its veth, and this program, run inside that namespace, gives the verdicts. It speaks the
nfnetlink_queue protocol over a netlink socket itself (no libnetfilter_queue). Packets wait in
arrival order, so a constant delay keeps them in order, as netem does.
"""

from __future__ import annotations

import argparse
import os
import random
import select
import socket
import struct
import time
from collections import deque

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5  # a full socket buffer must not lose packet notices silently
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1  # the packet's id and headers only: the payload is not needed
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
NF_DROP, NF_ACCEPT = 0, 1
QUEUE_MAXLEN = 65536  # packets held at once: past it the kernel drops (at 200 ms, ~300k packets/s)
RCVBUF_BYTES = 8 << 20


def _attr(kind: int, payload: bytes) -> bytes:
    header = struct.pack("=HH", 4 + len(payload), kind)
    return header + payload + b"\0" * (-len(payload) % 4)


def _message(msg_type: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST) -> bytes:
    body = struct.pack("!BBH", socket.AF_UNSPEC, 0, queue) + attrs  # nfgenmsg: family, version, queue
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg_type, flags, 0, 0) + body


def _attrs(data: bytes) -> dict[int, bytes]:
    found, at = {}, 0
    while at + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, at)
        if length < 4:
            break
        found[kind & 0x7FFF] = data[at + 4:at + length]
        at += (length + 3) & ~3
    return found


def bind(queue: int) -> socket.socket:
    """A netlink socket bound to NFQUEUE `queue`, copying metadata only; raises if the kernel refuses."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
    sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
    sock.bind((0, 0))
    for attrs in (_attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, socket.AF_INET)),
                  _attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
                  + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN))):
        sock.send(_message(NFQNL_MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK))
        reply = sock.recv(65536)
        error = struct.unpack_from("=i", reply, 16)[0] if struct.unpack_from("=H", reply, 4)[0] == NLMSG_ERROR else 0
        if error:
            raise OSError(-error, f"binding NFQUEUE {queue}: {os.strerror(-error)}")
    return sock


def packet_ids(data: bytes) -> list[int]:
    """The ids of the queued packets that one recv() brought (it may hold several messages)."""
    ids, at = [], 0
    while at + 16 <= len(data):
        length, msg_type = struct.unpack_from("=IH", data, at)
        if length < 16:
            break
        if msg_type == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            header = _attrs(data[at + 20:at + length]).get(NFQA_PACKET_HDR)
            if header is not None:
                ids.append(struct.unpack_from("!I", header)[0])
        at += (length + 3) & ~3
    return ids


def verdict(sock: socket.socket, queue: int, packet_id: int, accept: bool) -> None:
    sock.send(_message(NFQNL_MSG_VERDICT, queue,
                       _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT if accept else NF_DROP, packet_id))))


def serve(queue: int, delay_s: float, loss: float) -> None:
    """Until killed: each packet of the queue let through delay_s after it came, or dropped at rate `loss`."""
    sock = bind(queue)
    print(f"bound to NFQUEUE {queue}", flush=True)  # what `slow` waits for
    held: deque[tuple[float, int]] = deque()  # (when to let it through, packet id), in arrival order
    while True:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else None
        if select.select([sock], [], [], wait)[0]:
            now = time.monotonic()
            for packet_id in packet_ids(sock.recv(1 << 20)):
                if random.random() < loss:
                    verdict(sock, queue, packet_id, accept=False)
                else:
                    held.append((now + delay_s, packet_id))
        now = time.monotonic()
        while held and held[0][0] <= now:
            verdict(sock, queue, held.popleft()[1], accept=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m slurm.devcluster.netdelay", description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, required=True, help="the NFQUEUE number the iptables rules use")
    parser.add_argument("--delay-ms", type=float, required=True, help="how long each packet is held")
    parser.add_argument("--loss", type=float, default=0.0, help="percent of packets dropped")
    args = parser.parse_args(argv)
    serve(args.queue, args.delay_ms / 1000, args.loss / 100)


if __name__ == "__main__":
    main()
