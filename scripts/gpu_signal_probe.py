"""Which part of a GPU trainer's start takes SIGUSR1 from Python's handler (the supervisor's save-now
did not reach the trainer's handler on GPUs, session 49): after each step, a SIGUSR1 sent to itself
must reach Python's handler; SigCgt (the caught-signal mask) is printed beside."""

from __future__ import annotations

import os
import signal
import time

got: list[int] = []
signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))


def check(step: str) -> None:
    before = len(got)
    os.kill(os.getpid(), signal.SIGUSR1)
    deadline = time.monotonic() + 2
    while len(got) == before and time.monotonic() < deadline:
        time.sleep(0.01)
    caught = next(line for line in open("/proc/self/status") if line.startswith("SigCgt"))
    print(f"{step:40s} handler ran: {len(got) > before}   {caught.strip()}   python sees {signal.getsignal(signal.SIGUSR1)}",
          flush=True)


check("start")
import torch  # noqa: E402

check("import torch")
torch.zeros(1, device="cuda")
check("cuda init")
import torch.distributed as dist  # noqa: E402

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555", RANK="0", WORLD_SIZE="1")
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
check("init_process_group nccl")
t = torch.ones(4, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
check("all_reduce")
g = dist.new_group([0], backend="nccl")
dist.all_reduce(t, group=g)
torch.cuda.synchronize()
check("new nccl group + all_reduce")
f = torch.compile(lambda x: x * 2 + 1)
f(torch.ones(8, device="cuda"))
check("torch.compile")
import megatron.core  # noqa: E402,F401

check("import megatron.core")
from torch.utils.tensorboard import SummaryWriter  # noqa: E402

SummaryWriter("/tmp/sigprobe_tb").add_scalar("x", 1.0, 0)
check("tensorboard writer")
dist.destroy_process_group()
check("destroy_process_group")
