"""--colocate with offload: slime's defaults for --offload-*, the engine steps (--overlap, the
trainer's GPU list, each engine its slice by --base-gpu-id, --enable-memory-saver) checked by
SGLang's own parser, and the colocations that cannot fit refused before submission."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from contract.spec_loading import load_spec
from slurm.client import SlurmClient
from supervisor.engine_record import Engine
from supervisor.launcher import StepLauncher, engine_command
from supervisor.steps import StepSpec, srun_argv
from tests.jobs.helpers import job_flags
from tests.jobs.test_sglang_args import _spec, needs_parser

GPU_NODE = ["--rollout-engine", "sglang", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4",
            "--rollout-num-gpus-per-node", "4", "--rollout-num-gpus-per-engine", "2", "--colocate"]


@pytest.mark.parametrize(("flags", "train", "rollout"), [
    (["--colocate"], True, True), ([], False, False), (["--offload"], True, True),
    (["--colocate", "--no-offload-rollout"], True, False), (["--offload-train"], True, False),
])
def test_offload_defaults_follow_slime(tmp_path: Path, flags: list[str], train: bool, rollout: bool) -> None:
    spec, problems = load_spec(None, job_flags(tmp_path, "o") + flags)
    assert problems == []
    assert (spec.rollout.offloads_train, spec.rollout.offloads_rollout) == (train, rollout)


def _launch_kwargs(spec, monkeypatch) -> list[tuple[list[str], dict]]:
    """What StepLauncher.launch_engine asks of launch() for each engine of a colocated job on n0."""
    from supervisor import layout
    monkeypatch.setattr(SlurmClient, "hostnames", lambda self, nodelist: nodelist.split(","))
    monkeypatch.setattr(layout, "node_addresses", lambda nodes, timeout_s: {n: "10.0.0.1" for n in nodes})
    places = layout.from_environment(spec, 1.0, {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST_HET_GROUP_0": "n0"}).engines
    launcher = object.__new__(StepLauncher)
    launcher.job, launcher.python = SimpleNamespace(spec=spec), "python"
    calls = []
    launcher.launch = lambda name, kind, argv, nodes, group, **kw: calls.append((argv, kw)) or SimpleNamespace()
    for place in places:
        launcher.launch_engine(Engine(place))
    return calls


def test_colocated_engine_steps_overlap_the_trainer_and_take_their_slice(tmp_path: Path, monkeypatch) -> None:
    spec = _spec(None, job_flags(tmp_path, "c") + GPU_NODE + ["--sglang-mem-fraction-static", "0.7"])
    calls = _launch_kwargs(spec, monkeypatch)
    assert len(calls) == 2
    for k, (argv, kw) in enumerate(calls):
        assert kw["overlap"] and kw["gpus_per_node"] == 4  # the node's whole GPU list, as the trainer's
        assert argv[argv.index("--base-gpu-id") + 1] == str(2 * k) and argv[argv.index("--tp-size") + 1] == "2"
        assert "--enable-memory-saver" in argv
        srun = srun_argv("42", StepSpec(f"engine-{k}", tuple(argv), ("n0",), tmp_path / "log", **{
            "gpus_per_node": kw["gpus_per_node"], "overlap": kw["overlap"]}))
        assert "--overlap" in srun and "--gpus-per-node=4" in srun and "--exact" in srun
    plain = _spec(None, job_flags(tmp_path, "p") + GPU_NODE[:-1] + ["--rollout-num-gpus-per-node", "4"])
    assert engine_command(plain, _places(plain, monkeypatch)[1], "python")[-2:] != ["--enable-memory-saver"]


def _places(spec, monkeypatch):
    from supervisor import layout
    monkeypatch.setattr(SlurmClient, "hostnames", lambda self, nodelist: nodelist.split(","))
    monkeypatch.setattr(layout, "node_addresses", lambda nodes, timeout_s: {n: "10.0.0.1" for n in nodes})
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST_HET_GROUP_0": "n0", "SLURM_JOB_NODELIST_HET_GROUP_1": "n1"}
    return layout.from_environment(spec, 1.0, env).engines


@needs_parser
def test_colocated_engine_command_lines_parse_with_sglangs_parser(tmp_path: Path, monkeypatch) -> None:
    from jobs.sglang_args import parse_errors

    spec = _spec(None, job_flags(tmp_path, "c") + GPU_NODE + ["--sglang-mem-fraction-static", "0.7"])
    argvs = [argv for argv, _ in _launch_kwargs(spec, monkeypatch)]
    assert all(a[3] == "sglang.launch_server" for a in argvs)  # [python, -m, supervisor.with_key, MODULE, ...]
    assert parse_errors([a[4:] + ["--api-key=KEY"] for a in argvs]) == [None, None]


@pytest.mark.parametrize(("flags", "message"), [
    (["--sglang-mem-fraction-static", "0.95"], "rollout.sglang_args: --sglang-mem-fraction-static 0.95 leaves no "
                                               "room for the colocated trainer"),
    (["--no-offload-train"], "rollout.sglang_args: --colocate without --offload-train keeps the trainer's state"),
    (["--no-offload-train", "--sglang-mem-fraction-static", "0.7"], "rollout.sglang_args: --sglang-mem-fraction"
                                                                    "-static 0.7 leaves no room"),
    (["--rollout-num-gpus-per-node", "8"], "rollout.rollout_num_gpus_per_node: 8 != actor_num_gpus_per_node 4"),
])
def test_colocation_without_room_for_both_is_refused(tmp_path: Path, flags: list[str], message: str) -> None:
    from jobs.validate import validate

    spec, problems = load_spec(None, job_flags(tmp_path, "r") + GPU_NODE + flags)
    assert problems == []
    found = [p for p in validate(spec, partitions=False) if p.startswith("rollout.")]
    assert len(found) == 1 and found[0].startswith(message), found
