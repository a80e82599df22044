"""Engine command lines against SGLang's own parser (the sglang wheel in .sglang-args/, put there by
scripts/install.sh), and slime's own --sglang-* flags, which are not SGLang's, kept off them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from jobs import cli, sglang_args
from jobs.sglang_args import ParserUnavailable, parse_errors
from contract.spec import JobSpec, flag_value
from contract.spec_loading import finalize, load_spec
from rollout.launch import RouterLaunch, passthrough, router_command
from slurm.client import SlurmClient
from supervisor import layout
from supervisor.launcher import engine_command
from tests.jobs.helpers import job_flags

ROOT = Path(__file__).resolve().parents[2]
# slime's recipes' engine flags (scripts/run-qwen3-*.sh, run-qwen2.5-0.5B-reproducibility.sh)
RECIPE_FLAGS = ["--sglang-mem-fraction-static", "0.7", "--sglang-cuda-graph-bs", "1", "2", "4", "8", "16",
                "--sglang-enable-deterministic-inference", "--sglang-attention-backend", "flashinfer"]
SGLANG_SHAPES = {  # rollout GPUs, per engine, per node: one GPU per engine, TP 2, TP 8 on whole nodes
    "tp1": ["--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "1", "--rollout-num-gpus-per-node", "4"],
    "tp2": ["--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "2", "--rollout-num-gpus-per-node", "8"],
    "tp8": ["--rollout-num-gpus", "16", "--rollout-num-gpus-per-engine", "8", "--num-gpus-per-node", "8"],
}
needs_parser = pytest.mark.skipif(not (sglang_args.SIDE_FOLDER / "sglang").is_dir(),
                                  reason="SGLang's parser is not installed (run scripts/install.sh)")


def _spec(path: Path | None, argv: list[str]) -> JobSpec:
    spec, problems = load_spec(path, argv)
    assert not problems, problems
    return finalize(spec)


def _engine_argvs(spec: JobSpec, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """What the supervisor launches for every engine of spec, as sglang.launch_server sees it: the
    layout of a job on nodes n0..n9, each engine's command, the key supervisor.with_key adds."""
    monkeypatch.setattr(SlurmClient, "hostnames", lambda self, nodelist: nodelist.split(","))
    monkeypatch.setattr(layout, "node_addresses", lambda nodes, timeout_s: {n: f"10.0.0.{n[1:]}" for n in nodes})
    trainer_nodes, rollout_nodes = ["n0"], [f"n{k}" for k in range(1, 1 + spec.rollout.num_nodes)]
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST_HET_GROUP_0": ",".join(trainer_nodes),
           "SLURM_JOB_NODELIST_HET_GROUP_1": ",".join(rollout_nodes)}
    places = layout.from_environment(spec, 1.0, env).engines
    assert len(places) == spec.rollout.engine_count
    return [engine_command(spec, place, sys.executable)[3:] + ["--api-key=KEY"] for place in places]


@needs_parser
def test_every_engine_command_of_the_example_jobs_parses_with_sglangs_own_parser(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMRL_TINY_MODEL", str(tmp_path / "model"))
    monkeypatch.setenv("SLURMRL_TOY_DATA", str(tmp_path / "toy.jsonl"))
    monkeypatch.setenv("SLURMRL_DEMO_DATA", str(tmp_path / "demo.jsonl"))
    specs = [_spec(ROOT / "examples" / f"{name}_job.yaml", ["--job-dir", str(tmp_path / name)]) for name in ("toy", "demo")]
    specs += [_spec(None, job_flags(tmp_path, name) + ["--rollout-engine", "sglang", *shape, *RECIPE_FLAGS])
              for name, shape in SGLANG_SHAPES.items()]
    argvs = [argv for spec in specs for argv in _engine_argvs(spec, monkeypatch)]
    assert "--enable-deterministic-inference" in argvs[0] and "--tp-size" in argvs[-1]
    bad = [argvs[-1] + ["--mem-fraction-static", "abc"], argvs[-1] + ["--foo"]]
    errors = parse_errors(argvs + bad)  # one child process for all of them
    assert errors[:len(argvs)] == [None] * len(argvs)
    assert errors[len(argvs):] == ["argument --mem-fraction-static: invalid float value: 'abc'",
                                   "unrecognized arguments: --foo"]


@needs_parser
@pytest.mark.parametrize(("flags", "message"), [
    (["--sglang-mem-fraction-static", "abc"], "argument --mem-fraction-static: invalid float value: 'abc'"),
    (["--sglang-foo", "1"], "unrecognized arguments: --foo 1"),
])
def test_a_passthrough_sglang_rejects_is_refused_at_submit_with_its_reason(
        flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["submit", *job_flags(tmp_path, "bad"), *flags, "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == (f"slurmrl submit: error: rollout.sglang_args: SGLang refuses the engine command line: {message}; "
                   "fix or drop that --sglang-* flag\n")
    assert not (tmp_path / "job").exists()


def test_without_sglangs_parser_the_dry_run_says_so_once(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_args, "SIDE_FOLDER", tmp_path / "none")
    with pytest.raises(ParserUnavailable, match="none is missing; run scripts/install.sh"):
        parse_errors([["--model-path", "m"]])
    rc = cli.main(["submit", *job_flags(tmp_path, "unchecked"), *RECIPE_FLAGS, "--dry-run"])
    out, err = capsys.readouterr()
    assert rc == 0 and "#SBATCH" in out
    assert err == (f"slurmrl submit: note: the engine flags were not checked by SGLang's own parser: "
                   f"{tmp_path / 'none'} is missing; run scripts/install.sh\n")


def test_slimes_own_sglang_flags_get_their_effect_and_never_reach_the_engines(tmp_path: Path) -> None:
    from sglang_router.launch_router import parse_router_args

    spec = _spec(None, job_flags(tmp_path, "slime") + [  # 2 CPU engines
        "--sglang-router-request-timeout-secs", "600", "--sglang-server-concurrency", "16",
        "--sglang-mem-fraction-static", "0.7", "--num-gpus-per-node", "4", "--no-offload-train"])
    r = spec.rollout
    assert passthrough(r.sglang_args, "sglang") == ["--mem-fraction-static", "0.7"]
    assert flag_value(spec.trainer.train_args, "--rollout-concurrency") == "32"  # 16 per engine, 2 engines
    assert r.rollout_num_gpus_per_node == 4 and r.offload_train is False
    router = RouterLaunch("127.0.0.1", 1, 2, router_args=passthrough(r.router_args, "router"))
    assert parse_router_args(router_command(router)[3:]).request_timeout_secs == 600
    default = RouterLaunch("127.0.0.1", 1, 2)  # slime's default, 4 hours
    assert parse_router_args(router_command(default)[3:]).request_timeout_secs == 14400


@pytest.mark.parametrize(("flags", "message"), [
    (["--sglang-server-concurrency", "many"], "--sglang-server-concurrency many: needs one whole number above 0"),
    (["--sglang-server-concurrency", "8", "--rollout-concurrency", "64"],
     "--sglang-server-concurrency: --rollout-concurrency (requests in flight over all engines) is given too"),
    (["--sglang-router-request-timeout-secs", "60", "--router-request-timeout-secs", "60"],
     "--sglang-router-request-timeout-secs: the router's --router-request-timeout-secs is given too"),
])
def test_slime_flags_slurmrl_does_not_do_are_refused_with_their_reason(flags: list[str], message: str,
                                                                       tmp_path: Path) -> None:
    _, problems = load_spec(None, job_flags(tmp_path, "refused") + flags)
    assert [p for p in problems if p.startswith(message)] == problems, problems
    assert len(problems) == 1


def test_slimes_flags_in_the_yaml_sglang_args_are_routed_too(tmp_path: Path) -> None:
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("rollout:\n  sglang_args: [--sglang-config, x.yaml, --sglang-dtype, float32]\n")
    spec, problems = load_spec(spec_file, job_flags(tmp_path, "yaml"))
    assert problems == []
    assert spec.rollout.sglang_config == "x.yaml"  # slime's file, read at submission (contract/engine_groups.py)
    assert spec.rollout.sglang_args == ["--sglang-dtype", "float32"]


@needs_parser
def test_prefill_and_decode_engine_commands_parse_with_sglangs_own_parser(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--prefill-num-servers and an --sglang-config with per-group overrides, on the SGLang shapes."""
    config = tmp_path / "pd.yaml"
    config.write_text("sglang:\n  - name: actor\n    server_groups:\n"
                      "      - {worker_type: prefill, num_gpus: 4, overrides: {chunked_prefill_size: 4096}}\n"
                      "      - {worker_type: decode, num_gpus: 4, overrides: {mem_fraction_static: 0.8, "
                      "disaggregation_transfer_backend: nixl}}\n")
    specs = [_spec(None, job_flags(tmp_path, f"pd-{name}") + ["--rollout-engine", "sglang", *shape, *RECIPE_FLAGS,
                                                               "--prefill-num-servers", "1"])
             for name, shape in SGLANG_SHAPES.items()]
    specs.append(_spec(None, job_flags(tmp_path, "config") + ["--rollout-engine", "sglang", *SGLANG_SHAPES["tp2"],
                                                              "--sglang-config", str(config)]))
    argvs = [argv for spec in specs for argv in _engine_argvs(spec, monkeypatch)]
    modes = [flag_value(argv, "--disaggregation-mode") for argv in argvs]
    assert modes.count("prefill") == 3 + 2 and modes.count("decode") == len(argvs) - 5
    bootstrap_ports = [flag_value(argv, "--disaggregation-bootstrap-port") for argv in argvs]
    assert all((port is not None) == (mode == "prefill") for port, mode in zip(bootstrap_ports, modes))
    config_argvs = argvs[-4:]  # tp2 on 8 GPUs: 2 prefill engines, then 2 decode engines
    assert [flag_value(a, "--chunked-prefill-size") for a in config_argvs] == ["4096", "4096", None, None]
    assert [flag_value(a, "--mem-fraction-static") for a in config_argvs] == [None, None, "0.8", "0.8"]
    assert parse_errors(argvs) == [None] * len(argvs)
