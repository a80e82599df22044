"""Engine and router command lines, rewards, user-function loading, filters, debug data."""

from __future__ import annotations


import pytest

from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std
from rollout.launch import (
    EngineLaunch,
    LaunchError,
    RouterLaunch,
    cpu_engine_command,
    passthrough,
    redacted,
    router_command,
    sglang_command,
)
from rollout.plugins import load_function
from rollout.rewards import toy_reward
from rollout.sample import Sample


def test_passthrough_strips_the_prefix_and_keeps_values() -> None:
    argv = ["--sglang-mem-fraction-static", "0.8", "--lr", "1e-6", "--sglang-enable-memory-saver",
            "--router-policy=round_robin", "--sglang-context-length=4096"]
    assert passthrough(argv, "sglang") == ["--mem-fraction-static", "0.8", "--enable-memory-saver",
                                           "--context-length=4096"]
    assert passthrough(argv, "router") == ["--policy=round_robin"]


def test_engine_command_single_and_multi_node() -> None:
    one = EngineLaunch("/m", "10.0.0.5", 30000, tp=2, base_gpu_id=2, api_key="k", weight_version=3,
                       sglang_args=["--mem-fraction-static", "0.7"])
    assert sglang_command(one, python="py") == [
        "py", "-m", "sglang.launch_server", "--model-path", "/m", "--host", "10.0.0.5", "--port", "30000",
        "--tp-size", "2", "--base-gpu-id", "2", "--api-key", "k", "--weight-version", "3",
        "--mem-fraction-static", "0.7"]
    multi = EngineLaunch("/m", "h1", 30000, tp=16, nnodes=2, node_rank=1, dist_init_addr="h0:5000")
    argv = cpu_engine_command(multi, python="py")
    assert argv[:3] == ["py", "-m", "rollout.cpu_engine"]
    assert argv[argv.index("--nnodes"):argv.index("--nnodes") + 6] == [
        "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "h0:5000"]
    with pytest.raises(LaunchError, match="needs dist_init_addr"):
        EngineLaunch("/m", "h", 1, nnodes=2).flags()


def test_a_passthrough_may_not_override_what_slurmrl_sets() -> None:
    with pytest.raises(LaunchError, match="--sglang-port is set by slurmrl itself"):
        EngineLaunch("/m", "h", 1, sglang_args=["--port", "5"]).flags()
    with pytest.raises(LaunchError, match="--router-disable-retries is set by slurmrl itself"):
        router_command(RouterLaunch("h", 1, 2, router_args=["--disable-retries"]))


def test_router_command_turns_off_what_the_supervisor_owns_and_parses_with_the_real_router() -> None:
    argv = router_command(RouterLaunch("127.0.0.1", 30100, 30101, api_key="secret", policy="round_robin",
                                       router_args=["--log-level", "warn"]))
    for flag in ("--disable-health-check", "--disable-retries", "--disable-circuit-breaker"):
        assert flag in argv
    assert argv[argv.index("--prometheus-port") + 1] == "30101"
    # The real sglang-router's own parser accepts the line.
    from sglang_router.launch_router import parse_router_args
    parsed = parse_router_args(argv[3:])
    assert parsed.port == 30100 and parsed.policy == "round_robin" and parsed.disable_retries


def test_pd_router_and_engine_roles() -> None:
    """PD mode: the router starts with no workers (the supervisor adds each with its type); a
    prefill engine needs its bootstrap port; a role slurmrl does not know is refused."""
    from sglang_router.launch_router import parse_router_args
    parsed = parse_router_args(router_command(RouterLaunch("127.0.0.1", 30100, 30101, pd_disaggregation=True))[3:])
    assert parsed.pd_disaggregation and parsed.prefill_urls == [] and parsed.decode_urls == []
    with pytest.raises(LaunchError, match="--router-pd-disaggregation is set by slurmrl itself"):
        router_command(RouterLaunch("127.0.0.1", 1, 2, router_args=["--pd-disaggregation"]))
    prefill = EngineLaunch("/m", "h", 1, role="prefill", bootstrap_port=2).flags()
    assert prefill[prefill.index("--disaggregation-mode") + 1] == "prefill"
    assert prefill[prefill.index("--disaggregation-bootstrap-port") + 1] == "2"
    assert "--prefill-round-robin-balance" in EngineLaunch("/m", "h", 1, role="decode").flags()
    with pytest.raises(LaunchError, match="needs its bootstrap_port"):
        EngineLaunch("/m", "h", 1, role="prefill").flags()
    with pytest.raises(LaunchError, match="engine role 'encoder' is not one of regular, prefill, decode"):
        EngineLaunch("/m", "h", 1, role="encoder").flags()
    with pytest.raises(LaunchError, match="--sglang-disaggregation-mode is set by slurmrl itself"):
        EngineLaunch("/m", "h", 1, sglang_args=["--disaggregation-mode", "decode"]).flags()


def test_redacted_hides_keys() -> None:
    assert redacted(["x", "--api-key", "s3cret", "--api-key=abc", "--port", "1"]) == [
        "x", "--api-key", "***", "--api-key=***", "--port", "1"]


def test_toy_reward() -> None:
    assert toy_reward(" 7 and more", "7") == 1.0
    assert toy_reward("8", "7") == 0.0 and toy_reward("", "7") == 0.0


def test_load_function_errors_name_the_flag() -> None:
    assert load_function("rollout.rewards.toy_reward", "--custom-rm-path") is toy_reward
    with pytest.raises(ValueError, match="--custom-rm-path 'toy_reward' must be a dotted path"):
        load_function("toy_reward", "--custom-rm-path")
    with pytest.raises(ValueError, match="cannot import no_such_pkg"):
        load_function("no_such_pkg.f", "--custom-rm-path")
    with pytest.raises(ValueError, match="rollout.rewards has no function nope"):
        load_function("rollout.rewards.nope", "--custom-rm-path")


def test_check_reward_nonzero_std_filter() -> None:
    def group(*rewards):
        return [Sample(index=i, group_index=0, prompt="p", reward=r) for i, r in enumerate(rewards)]
    assert check_reward_nonzero_std(None, group(0.0, 1.0, 1.0)).keep
    assert not check_reward_nonzero_std(None, group(1.0, 1.0, 1.0)).keep


def test_engine_command_parses_with_sglangs_own_parser() -> None:
    # SGLang cannot be installed on the CPU machines (CUDA wheels, ~4 GiB); on a GPU cluster with
    # the sglang extra this runs.
    server_args = pytest.importorskip("sglang.srt.server_args", reason="SGLang is not installed here")
    import argparse
    parser = argparse.ArgumentParser()
    server_args.ServerArgs.add_cli_args(parser)
    engine = EngineLaunch("/m", "10.0.0.5", 30000, tp=2, nnodes=2, node_rank=1, dist_init_addr="10.0.0.4:5000",
                          api_key="k", sglang_args=["--mem-fraction-static", "0.7"])
    parsed = parser.parse_args(sglang_command(engine)[3:])
    assert (parsed.tp_size, parsed.nnodes, parsed.node_rank, parsed.mem_fraction_static) == (2, 2, 1, 0.7)
