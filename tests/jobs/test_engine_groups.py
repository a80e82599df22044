"""--prefill-num-servers and --sglang-config (slime's): read at submission into the job's engine
groups, or refused before anything is submitted with one line naming the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from contract import engine_groups
from contract.spec import SpecError
from contract.spec_loading import read_job_spec
from jobs.submit import prepare
from tests.jobs.helpers import job_flags

GPU = ["--rollout-engine", "sglang", "--rollout-num-gpus", "8", "--rollout-num-gpus-per-engine", "2"]


def _problems(tmp_path: Path, *flags: str) -> list[str]:
    try:
        prepare(None, job_flags(tmp_path, "groups") + list(flags), partitions=False)
    except SpecError as err:
        return err.problems
    return []


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "sglang.yaml"
    path.write_text(text)
    return str(path)


def test_prefill_num_servers_makes_prefill_then_decode_engines(tmp_path: Path) -> None:
    spec = prepare(None, job_flags(tmp_path, "pd") + ["--rollout-num-engines", "3", "--prefill-num-servers", "1"],
                   partitions=False)
    assert spec.rollout.engine_groups == ["prefill 1", "decode 2"]
    assert [role for role, _ in engine_groups.engine_roles(spec)] == ["prefill", "decode", "decode"]
    assert engine_groups.is_pd(spec)
    # what the supervisor reads back from the job dir is the same topology
    Path(spec.job_dir).mkdir(parents=True)
    (Path(spec.job_dir) / "spec.yaml").write_text(spec.to_yaml())
    assert engine_groups.engine_roles(read_job_spec(spec.job_dir)) == engine_groups.engine_roles(spec)


def test_without_either_flag_every_engine_is_regular(tmp_path: Path) -> None:
    spec = prepare(None, job_flags(tmp_path, "plain"), partitions=False)
    assert spec.rollout.engine_groups == [] and not engine_groups.is_pd(spec)
    assert [role for role, _ in engine_groups.engine_roles(spec)] == ["regular", "regular"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--prefill-num-servers", "2"], "rollout.prefill_num_servers: --prefill-num-servers leaves no decode engine "
                                     "(2 prefill of 2 engines); lower --prefill-num-servers below the number"),
    ([*GPU, "--prefill-num-servers", "4"], "rollout.prefill_num_servers: --prefill-num-servers leaves no decode"),
    (["--prefill-num-servers", "0"], "rollout.prefill_num_servers: --prefill-num-servers leaves no prefill engine"),
    (["--prefill-num-servers", "1", "--sglang-router-ip", "10.0.0.1", "--sglang-router-port", "3000"],
     "rollout.sglang_router_ip: an external router's mode and workers are its own"),
])
def test_pd_counts_that_cannot_run_are_refused(tmp_path: Path, flags: list[str], message: str) -> None:
    problems = _problems(tmp_path, *flags)
    assert len(problems) == 1 and problems[0].startswith(message), problems


PD_CONFIG = """
sglang:
  - name: actor
    server_groups:
      - worker_type: prefill
        num_gpus: 2
        overrides: {chunked_prefill_size: 2048, trust_remote_code: true}
      - worker_type: decode
        num_gpus: 6
"""


def test_an_sglang_config_becomes_the_groups_it_describes(tmp_path: Path) -> None:
    spec = prepare(None, job_flags(tmp_path, "cfg") + [*GPU, "--sglang-config", _config(tmp_path, PD_CONFIG)],
                   partitions=False)
    assert spec.rollout.engine_groups == ["prefill 1 --chunked-prefill-size 2048 --trust-remote-code", "decode 3"]
    assert Path(spec.rollout.sglang_config).is_absolute()
    roles = engine_groups.engine_roles(spec)
    assert roles[0] == ("prefill", ("--chunked-prefill-size", "2048", "--trust-remote-code"))
    assert roles[1:] == [("decode", ())] * 3


@pytest.mark.parametrize(("config", "extra", "message"), [
    (PD_CONFIG.replace("num_gpus: 6", "num_gpus: 4"), [],
     "server_groups: their num_gpus add up to 6, --rollout-num-gpus is 8 (slime's rule: they must be equal); "
     "give --rollout-num-gpus 6"),
    (PD_CONFIG.replace("decode", "prefill"), [], "rollout.sglang_config: --sglang-config leaves no decode engine"),
    (PD_CONFIG.replace("decode", "regular"), [], "rollout.sglang_config: --sglang-config mixes regular engines"),
    (PD_CONFIG + "  - name: ref\n    model_path: /ref\n    server_groups: [{worker_type: regular, num_gpus: 2}]\n",
     [], "sglang[1]: several models (each behind its own router) are not supported"),
    (PD_CONFIG.replace("name: actor", "name: actor\n    update_weights: false"), [],
     "sglang[0].update_weights: a frozen model"),
    (PD_CONFIG.replace("worker_type: decode", "worker_type: placeholder"), [],
     "server_groups[1].worker_type: placeholder: reserving GPUs without an engine is not supported"),
    (PD_CONFIG.replace("num_gpus: 6", "num_gpus: 6\n        num_gpus_per_engine: 3"), [],
     "server_groups[1].num_gpus_per_engine: 3 differs from --rollout-num-gpus-per-engine 2"),
    (PD_CONFIG.replace("chunked_prefill_size: 2048", "tp_size: 4"), [],
     "rollout.sglang_config: the prefill group's overrides: --tp-size is set by slurmrl itself"),
    (PD_CONFIG.replace("worker_type: decode", "worker_type: decoder"), [],
     "server_groups[1].worker_type: 'decoder' is not one of regular, prefill, decode"),
    ("sglang: {}\n", [], "needs a top-level 'sglang' list of models"),
    (PD_CONFIG, ["--prefill-num-servers", "1"], "rollout.sglang_config: --sglang-config and --prefill-num-servers "
                                                "are mutually exclusive"),
])
def test_an_sglang_config_that_cannot_run_is_refused(tmp_path: Path, config: str, extra: list[str],
                                                     message: str) -> None:
    problems = _problems(tmp_path, *GPU, "--sglang-config", _config(tmp_path, config), *extra)
    assert len(problems) == 1 and message in problems[0], problems


def test_a_missing_sglang_config_is_named(tmp_path: Path) -> None:
    problems = _problems(tmp_path, *GPU, "--sglang-config", str(tmp_path / "nope.yaml"))
    assert len(problems) == 1 and "nope.yaml: no such file" in problems[0], problems


def test_the_cpu_engine_counts_engines_not_gpus(tmp_path: Path) -> None:
    config = _config(tmp_path, PD_CONFIG.replace("num_gpus: 2", "num_gpus: 1").replace("num_gpus: 6", "num_gpus: 1"))
    spec = prepare(None, job_flags(tmp_path, "cpu") + ["--rollout-num-gpus-per-engine", "1", "--sglang-config",
                                                       config], partitions=False)
    assert [role for role, _ in engine_groups.engine_roles(spec)] == ["prefill", "decode"]
    problems = _problems(tmp_path, "--rollout-num-engines", "3", "--sglang-config", config)
    assert len(problems) == 1 and "they make 2 engines, the job has 3 (--rollout-num-engines)" in problems[0]


def test_a_regular_config_gives_its_groups_their_own_flags(tmp_path: Path) -> None:
    config = _config(tmp_path, "sglang:\n  - name: default\n    server_groups:\n"
                               "      - {worker_type: regular, num_gpus: 4, overrides: {mem_fraction_static: 0.6}}\n"
                               "      - {worker_type: regular, num_gpus: 4}\n")
    spec = prepare(None, job_flags(tmp_path, "regular") + [*GPU, "--sglang-config", config], partitions=False)
    assert not engine_groups.is_pd(spec)
    assert engine_groups.engine_roles(spec) == [("regular", ("--mem-fraction-static", "0.6"))] * 2 + \
        [("regular", ())] * 2
