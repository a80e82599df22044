"""--rollout-engine standin: the stand-in engine on GPUs, placed as SGLang's engines are. What the
supervisor launches for it (the allocation's GPUs, each engine step's GPUs, --overlap where engines
share a GPU, --device cuda and --base-gpu-id on the command line, which the engine's own parser
takes) and what validation refuses before anything is submitted. The engine on a real GPU under a
real SLURM: tests/gpu/test_gpu_job.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from contract.spec import JobSpec
from contract.spec_loading import load_spec
from jobs.hetjob import het_groups
from jobs.validate import validate
from rollout.cpu_engine.args import parse_args
from slurm.client import SlurmClient
from supervisor.engine_record import Engine
from supervisor.launcher import StepLauncher
from tests.jobs.helpers import job_flags
from tests.jobs.test_sglang_args import _spec, needs_parser

TRAINER_GPU = ["--actor-num-gpus-per-node", "1", "--rollout-engine", "standin"]


def _flags(tmp_path: Path, *extra: str) -> list[str]:
    # the helper's job is CPU engines: --rollout-num-engines 2 is dropped unless a test gives its own
    base = job_flags(tmp_path, "s")
    i = base.index("--rollout-num-engines")
    return base[:i] + base[i + 2:] + TRAINER_GPU + list(extra)


def _launched(spec: JobSpec, monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], dict[str, Any]]]:
    """(argv, launch() keywords) of every engine step the supervisor starts, on rollout node n1
    (the trainer's node n0 with --colocate)."""
    from supervisor import layout
    monkeypatch.setattr(SlurmClient, "hostnames", lambda self, nodelist: nodelist.split(","))
    monkeypatch.setattr(layout, "node_addresses", lambda nodes, timeout_s: {n: "10.0.0.1" for n in nodes})
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST_HET_GROUP_0": "n0", "SLURM_JOB_NODELIST_HET_GROUP_1": "n1"}
    launcher = object.__new__(StepLauncher)
    launcher.job, launcher.python = SimpleNamespace(spec=spec), "python"
    calls: list[tuple[list[str], dict[str, Any]]] = []
    launcher.launch = lambda name, kind, argv, nodes, group, **kw: calls.append((argv, kw)) or SimpleNamespace()
    for place in layout.from_environment(spec, 1.0, env).engines:
        launcher.launch_engine(Engine(place))
    return calls


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_one_engine_per_gpu_each_bound_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(None, _flags(tmp_path, "--rollout-num-gpus", "2", "--rollout-num-gpus-per-node", "2",
                              "--update-weight-transport", "nccl"))
    trainer, rollout = het_groups(spec)
    assert (trainer.gpus_per_node, rollout.gpus_per_node, rollout.ntasks_per_node) == (1, 2, 2)
    calls = _launched(spec, monkeypatch)
    assert len(calls) == 2
    for argv, kw in calls:
        assert argv[3] == "rollout.cpu_engine" and kw["gpus_per_node"] == 1 and not kw["overlap"]
        args = parse_args(argv[4:])  # the engine's own parser: [python, -m, supervisor.with_key, MODULE, ...]
        assert (args.device, args.base_gpu_id, args.ignored["tp_size"]) == ("cuda", 0, 1)


def test_engines_beyond_one_per_gpu_share_them_in_turn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(None, _flags(tmp_path, "--rollout-num-gpus", "2", "--rollout-num-gpus-per-node", "2",
                              "--rollout-num-engines", "4"))
    _, rollout = het_groups(spec)
    assert (rollout.nodes, rollout.gpus_per_node, rollout.ntasks_per_node) == (1, 2, 4)
    calls = _launched(spec, monkeypatch)
    # each step sees the node's 2 GPUs (--overlap: SLURM lets the steps share them) and takes one
    assert [(kw["gpus_per_node"], kw["overlap"]) for _, kw in calls] == [(2, True)] * 4
    assert [_value(argv, "--base-gpu-id") for argv, _ in calls] == ["0", "1", "0", "1"]
    one_gpu = _spec(None, _flags(tmp_path / "one", "--rollout-num-gpus", "1", "--rollout-num-engines", "2"))
    assert [(kw["gpus_per_node"], _value(argv, "--base-gpu-id")) for argv, kw in _launched(one_gpu, monkeypatch)] \
        == [(1, "0"), (1, "0")]


def test_colocated_standin_shares_the_trainers_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(None, _flags(tmp_path, "--rollout-num-gpus", "1", "--rollout-num-gpus-per-node", "1", "--colocate"))
    [group] = het_groups(spec)
    assert (group.gpus_per_node, group.ntasks_per_node) == (1, 2)  # the trainer's task and the engine's
    [(argv, kw)] = _launched(spec, monkeypatch)
    assert kw["gpus_per_node"] == 1 and kw["overlap"]
    assert _value(argv, "--device") == "cuda" and _value(argv, "--base-gpu-id") == "0"
    assert "--enable-memory-saver" in argv


@needs_parser
def test_the_standin_command_line_parses_with_sglangs_parser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from jobs.sglang_args import parse_errors

    spec = _spec(None, _flags(tmp_path, "--rollout-num-gpus", "1", "--rollout-num-engines", "2",
                              "--sglang-mem-fraction-static", "0.4"))
    argvs = [argv[4:] + ["--api-key=KEY"] for argv, _ in _launched(spec, monkeypatch)]
    assert parse_errors(argvs) == [None, None]


@pytest.mark.parametrize(("extra", "problem"), [
    (["--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2"],
     "rollout.rollout_num_gpus_per_engine: 2, but the standin engine runs on one GPU"),
    (["--rollout-num-gpus", "2", "--rollout-num-engines", "3"],
     "rollout.num_engines: 3 standin engines on 2 GPUs; give a multiple of 2"),
    (["--rollout-num-gpus", "1", "--rollout-num-engines", "2", "--update-weight-transport", "nccl"],
     "--update-weight-transport nccl: NCCL refuses two ranks on one GPU, and 2 engines share 1 GPUs"),
    (["--rollout-num-gpus", "1", "--rollout-num-gpus-per-node", "1", "--colocate", "--update-weight-transport", "nccl"],
     "NCCL refuses two ranks on one GPU, and the colocated trainer and engines share their GPUs"),
    (["--rollout-num-gpus", "1", "--update-weight-transport", "tensor"],
     "--update-weight-transport tensor hands the trainer's memory to engines on its own GPU, but the engines are "
     "not colocated (--colocate); give --update-weight-transport disk"),
    (["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-node", "2", "--colocate",
      "--update-weight-transport", "tensor"],
     "--update-weight-transport tensor: trainer rank 0 sends every weight, and an engine can map only its own "
     "GPU's memory; with 2 trainer GPUs"),
    (["--rollout-num-gpus", "2", "--prefill-num-servers", "1"],
     "rollout: the standin engine's prefill/decode disaggregation runs on CPU only"),
    (["--rollout-num-gpus", "1", "--sglang-device", "cpu"], "rollout: --sglang-device is set by slurmrl itself"),
])
def test_what_the_standin_engine_cannot_do_is_refused(tmp_path: Path, extra: list[str], problem: str) -> None:
    spec, problems = load_spec(None, _flags(tmp_path, *extra))
    problems += validate(spec, partitions=None)
    assert any(problem in p for p in problems), problems


def test_a_colocated_job_on_one_gpu_takes_its_weights_by_reference(tmp_path: Path) -> None:
    spec, problems = load_spec(None, _flags(tmp_path, "--rollout-num-gpus", "1", "--rollout-num-gpus-per-node", "1",
                                            "--colocate", "--update-weight-transport", "tensor"))
    assert problems + validate(spec, partitions=None) == []


def test_the_cpu_engine_refuses_a_gpu_device(tmp_path: Path) -> None:
    spec, problems = load_spec(None, job_flags(tmp_path, "c") + ["--sglang-device", "cuda"])
    problems += validate(spec, partitions=None)
    assert any("--sglang-device cuda, but the cpu engine's steps are bound no GPU; use --rollout-engine standin" in p
               for p in problems), problems
