"""Command lines for the rollout steps: SGLang engines (real, or the CPU engine with the same flags)
and the sglang-router. The supervisor runs them as srun steps; nothing here starts a process."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

# Flags slurmrl sets itself: a passthrough may not override them.
_ENGINE_OWNED = {"model-path", "host", "port", "tp-size", "nnodes", "node-rank", "dist-init-addr", "base-gpu-id",
                 "api-key", "weight-version", "disaggregation-mode", "disaggregation-bootstrap-port"}
_ROUTER_OWNED = {"host", "port", "api-key", "prometheus-port", "prometheus-host", "disable-health-check",
                 "disable-retries", "disable-circuit-breaker", "worker-urls", "pd-disaggregation", "prefill", "decode"}
# An engine's part in prefill/decode disaggregation (SGLang's --disaggregation-mode; "regular": whole requests)
ROLES = ("regular", "prefill", "decode")
SECRET_FLAGS = ("--api-key",)
# slime's --sglang-router-request-timeout-secs default: one generate request through the router
ROUTER_REQUEST_TIMEOUT_S = 14400


class LaunchError(ValueError):
    """A passthrough flag that cannot be honoured; the message names it and the fix."""


def passthrough(argv: list[str], prefix: str) -> list[str]:
    """`--sglang-mem-fraction-static 0.8` -> `--mem-fraction-static 0.8` (and `--X=v` forms) for
    every `--PREFIX-X` in argv; other tokens are the caller's and are not returned."""
    out, take_value = [], False
    for token in argv:
        if token.startswith(f"--{prefix}-"):
            out.append("--" + token[len(prefix) + 3:])
            take_value = "=" not in token
        elif take_value and not token.startswith("--"):
            out.append(token)
            take_value = False
        else:
            take_value = False
    return out


def _check_owned(args: list[str], owned: set[str], prefix: str) -> None:
    for token in args:
        name = token[2:].split("=", 1)[0] if token.startswith("--") else None
        if name in owned:
            raise LaunchError(f"--{prefix}-{name} is set by slurmrl itself; remove it (use the job spec's own field)")


@dataclass(frozen=True)
class EngineLaunch:
    """One engine (all its nodes share these, but node_rank). tp = --rollout-num-gpus-per-engine."""

    model_path: str
    host: str
    port: int
    tp: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # host:port of node-rank 0, for multi-node engines
    base_gpu_id: int = 0
    api_key: str | None = None
    weight_version: int | None = None
    sglang_args: list[str] = field(default_factory=list)  # already stripped of --sglang-
    role: str = "regular"  # one of ROLES
    bootstrap_port: int | None = None  # a prefill engine's KV bootstrap server (decode engines fetch there)
    device: str | None = None  # SGLang's --device, where slurmrl sets it (the stand-in on GPUs: cuda)

    def flags(self) -> list[str]:
        _check_owned(self.sglang_args, _ENGINE_OWNED | ({"device"} if self.device else set()), "sglang")
        argv = ["--model-path", self.model_path, "--host", self.host, "--port", str(self.port),
                "--tp-size", str(self.tp), "--base-gpu-id", str(self.base_gpu_id)]
        if self.device:
            argv += ["--device", self.device]
        if self.nnodes > 1:
            if not self.dist_init_addr:
                raise LaunchError("a multi-node engine needs dist_init_addr (node-rank 0's host:port)")
            argv += ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank),
                     "--dist-init-addr", self.dist_init_addr]
        if self.api_key:
            argv += ["--api-key", self.api_key]
        if self.weight_version is not None:
            argv += ["--weight-version", str(self.weight_version)]  # SGLang's flag, a string as on its HTTP API
        return argv + self._role_flags() + list(self.sglang_args)

    def _role_flags(self) -> list[str]:
        """slime's: prefill engines serve KV on a bootstrap port; decode engines balance over
        prefill ranks round robin (the transfer backend stays SGLang's default, or --sglang-*)."""
        if self.role not in ROLES:
            raise LaunchError(f"engine role {self.role!r} is not one of {', '.join(ROLES)}")
        if self.role == "prefill":
            if self.bootstrap_port is None:
                raise LaunchError("a prefill engine needs its bootstrap_port")
            return ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        if self.role == "decode":
            return ["--disaggregation-mode", "decode", "--prefill-round-robin-balance"]
        return []


def sglang_command(engine: EngineLaunch, python: str = sys.executable) -> list[str]:
    return [python, "-m", "sglang.launch_server", *engine.flags()]


def cpu_engine_command(engine: EngineLaunch, python: str = sys.executable) -> list[str]:
    """The stand-in engine (rollout/cpu_engine) takes SGLang's flags (those meaningless to it are
    accepted and ignored), on the CPU or, with device cuda, on its GPU."""
    return [python, "-m", "rollout.cpu_engine", *engine.flags()]


@dataclass(frozen=True)
class RouterLaunch:
    host: str
    port: int
    prometheus_port: int  # the router binds 0.0.0.0:29000 by default: every router needs its own
    api_key: str | None = None
    policy: str = "cache_aware"
    pd_disaggregation: bool = False  # PD mode: workers join with worker_type prefill/decode (POST /workers)
    router_args: list[str] = field(default_factory=list)  # already stripped of --router-


def router_command(router: RouterLaunch, python: str = sys.executable) -> list[str]:
    """The supervisor owns membership: the router's own health checks (every 60 s, never removes),
    retries (re-send timed-out requests, duplicating generation) and circuit breaker (refuses
    traffic for 60 s) are turned off; failed workers are removed by the supervisor."""
    _check_owned(router.router_args, _ROUTER_OWNED, "router")
    argv = [python, "-m", "sglang_router.launch_router", "--host", router.host, "--port", str(router.port),
            "--prometheus-host", router.host, "--prometheus-port", str(router.prometheus_port),
            "--policy", router.policy, "--disable-health-check", "--disable-retries", "--disable-circuit-breaker",
            "--request-timeout-secs", str(ROUTER_REQUEST_TIMEOUT_S),
            # info logs every request (thousands of lines a rollout); --router-log-level info brings them back
            "--log-level", "warn"]  # a passthrough, later, overrides these
    if router.pd_disaggregation:
        argv.append("--pd-disaggregation")  # no --prefill/--decode: the supervisor adds each at runtime
    if router.api_key:
        argv += ["--api-key", router.api_key]
    return argv + list(router.router_args)


def redacted(argv: list[str]) -> list[str]:
    """argv fit for a log: secrets replaced (invariant 6: no key is ever printed or logged)."""
    out = list(argv)
    for i, token in enumerate(out):
        if token in SECRET_FLAGS and i + 1 < len(out):
            out[i + 1] = "***"
        elif token.startswith(tuple(f + "=" for f in SECRET_FLAGS)):
            out[i] = token.split("=", 1)[0] + "=***"
    return out
