"""`slurmrl submit` refuses, before anything is written, what slime refuses and what would fail at
run time, each problem one line naming the flag and the fix, every problem of a submission at once;
and says in one line that SLURM has no configuration here instead of sbatch's DNS SRV errors.
The dry runs need no SLURM (the partition check is skipped where sinfo does not answer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs import cli
from slurm.configuration import DEFAULT_CONF_FILES
from tests.jobs.helpers import job_flags

ERROR = "slurmrl submit: error: "
CONTEXT = 64  # the model's max_position_embeddings in these tests


def _dry_run(tmp_path: Path, flags: list[str], capsys: pytest.CaptureFixture[str],
             config: dict | None = None) -> tuple[int, list[str]]:
    argv = job_flags(tmp_path, "checks")
    if config is not None:
        (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    rc = cli.main(["submit", *argv, *flags, "--dry-run"])
    err = capsys.readouterr().err
    return rc, [line for line in err.splitlines() if line.startswith(ERROR)]


# slime's checks (slime/utils/arguments.py, slime_validate_args), with the flags that satisfy them
SLIME_REFUSES = {
    "reinforce++": (["--advantage-estimator", "reinforce_plus_plus"], ["--normalize-advantages"],
                    "--advantage-estimator reinforce_plus_plus requires advantage normalization (as in slime): add "
                    "--normalize-advantages"),
    "reinforce++-baseline": (["--advantage-estimator", "reinforce_plus_plus_baseline"], ["--normalize-advantages"],
                             "--advantage-estimator reinforce_plus_plus_baseline requires advantage normalization"),
    "over-sampling": (["--rollout-batch-size", "4", "--over-sampling-batch-size", "2"],
                      ["--over-sampling-batch-size", "4"],
                      "--over-sampling-batch-size 2 should be greater than or equal to --rollout-batch-size 4"),
    "greedy": (["--rollout-temperature", "0"], ["--rollout-temperature", "0.6"],
               "--rollout-temperature 0.0: must be > 0; temperature 0 is greedy decoding and is not a valid RL "
               "policy"),
}


@pytest.mark.parametrize("case", list(SLIME_REFUSES))
def test_what_slime_refuses_is_refused(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad, fix, message = SLIME_REFUSES[case]
    rc, errors = _dry_run(tmp_path, bad, capsys)
    assert rc == 2 and len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "job").exists()
    rc, errors = _dry_run(tmp_path, bad + fix, capsys)  # the fix the line names is accepted
    assert rc == 0 and not errors, errors


def test_flash_attention_on_a_cpu_trainer_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The megatron backend's CPU attention has no flash kernel: its trainer crashed at the first
    step ("No available kernel", tests/trainer/test_megatron_attention.py)."""
    rc, errors = _dry_run(tmp_path, ["--attention-backend", "flash"], capsys)  # job_flags: no GPUs per node
    assert rc == 2 and len(errors) == 1, errors
    assert "--attention-backend flash: this trainer runs on CPU" in errors[0]
    assert "use --attention-backend auto" in errors[0]
    for runs in (["--train-backend", "fsdp"],  # the fsdp backend's CPU attention takes the flash kernel
                 ["--actor-num-gpus-per-node", "4"]):  # GPUs: flash-attention's varlen kernel
        rc, errors = _dry_run(tmp_path, ["--attention-backend", "flash", *runs], capsys)
        assert rc == 0 and not errors, (runs, errors)
    rc, errors = _dry_run(tmp_path, ["--attention-backend", "fused", "--train-backend", "fsdp"], capsys)
    assert rc == 2 and "--attention-backend fused: SDPA's cuDNN and memory-efficient kernels run on CUDA only" \
        in errors[0]


@pytest.mark.parametrize("flags, message, fits", [
    (["--rollout-max-response-len", str(CONTEXT)],
     f"--rollout-max-response-len {CONTEXT} reaches the engines' context of {CONTEXT} tokens (max_position_embeddings "
     "in MODEL/config.json) with any prompt", ["--rollout-max-response-len", str(CONTEXT - 2)]),
    (["--rollout-max-prompt-len", "20", "--rollout-max-response-len", str(CONTEXT - 20)],
     f"--rollout-max-response-len {CONTEXT - 20} reaches the engines' context of {CONTEXT} tokens "
     "(max_position_embeddings in MODEL/config.json) with prompts of up to 20 tokens (--rollout-max-prompt-len)",
     ["--rollout-max-response-len", str(CONTEXT - 21)]),
    (["--rollout-max-context-len", "33", "--rollout-max-response-len", "32"],
     "with prompts of up to 32 tokens (--rollout-max-context-len - 1)", ["--rollout-max-response-len", "31"]),
    (["--rollout-max-response-len", "8", "--eval-max-response-len", "100"],
     "--eval-max-response-len 100 reaches the engines' context",
     ["--eval-max-response-len", "62"]),
    (["--sglang-context-length", "32", "--rollout-max-response-len", "40"],
     "--rollout-max-response-len 40 reaches the engines' context of 32 tokens (--sglang-context-length)",
     ["--rollout-max-response-len", "30"]),
])
def test_a_response_beyond_the_context_is_refused(flags: list[str], message: str, fits: list[str], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Engines refuse a request whose prompt + max_new_tokens reaches their context, as SGLang does."""
    config = {"max_position_embeddings": CONTEXT}
    rc, errors = _dry_run(tmp_path, flags, capsys, config)
    assert rc == 2 and len(errors) == 1, errors
    assert message.replace("MODEL", str(tmp_path / "model")) in errors[0], errors
    assert "or less" in errors[0]
    rc, errors = _dry_run(tmp_path, flags + fits, capsys, config)
    assert rc == 0 and not errors, errors


def test_every_problem_of_a_submission_is_reported_at_once(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    flags = [*SLIME_REFUSES["reinforce++"][0], *SLIME_REFUSES["over-sampling"][0], *SLIME_REFUSES["greedy"][0],
             "--attention-backend", "flash", "--rollout-max-response-len", "100", "--hidden-size", "32",
             "--lrr", "1e-6", "--num-steps-per-rollout", "3", "--rollout-num-engines", "0"]
    rc, errors = _dry_run(tmp_path, flags, capsys, {"max_position_embeddings": CONTEXT, "hidden_size": 64})
    assert rc == 2
    expected = [SLIME_REFUSES[case][2] for case in ("reinforce++", "over-sampling", "greedy")] + [
        "--attention-backend flash: this trainer runs on CPU",
        "--rollout-max-response-len 100 reaches the engines' context",
        "--hidden-size 32 disagrees with",
        "unknown flag --lrr (did you mean --lr?)",
        "--num-steps-per-rollout 3 must divide",
        "rollout.num_engines: the cpu engine needs --rollout-num-engines 1 or more"]
    for message in expected:
        assert sum(message in line for line in errors) == 1, (message, errors)
    assert len(errors) == len(expected), errors
    assert not (tmp_path / "job").exists()


def test_submit_without_a_slurm_configuration_says_so_in_one_line(
        slurm_programs: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """No SLURM_CONF and no slurm.conf: SLURM's programs fall back to a DNS SRV lookup and print its
    failure (sbatch's, twice, before); one line names what is missing and the fix instead."""
    if any(path.is_file() for path in DEFAULT_CONF_FILES):
        pytest.skip("this machine has a SLURM configuration of its own")
    monkeypatch.delenv("SLURM_CONF", raising=False)
    job_dir = tmp_path / "job"
    rc = cli.main(["submit", *job_flags(tmp_path, "no-conf", job_dir)])
    out, err = capsys.readouterr()
    assert rc != 0 and not out
    assert err.splitlines() == [err.strip()], err  # one line
    assert err.startswith(f"{ERROR}no SLURM configuration: SLURM_CONF is unset and there is no slurm.conf at "
                          "/etc/slurm/slurm.conf"), err
    assert "`slurmrl cluster up`" in err and "export SLURM_CONF=" in err
    assert not job_dir.exists()
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "nowhere.conf"))
    rc = cli.main(["submit", *job_flags(tmp_path, "no-conf", job_dir)])
    err = capsys.readouterr().err
    assert rc != 0 and err == f"{ERROR}SLURM_CONF={tmp_path / 'nowhere.conf'} names no file; for the devcluster " \
        "run `slurmrl cluster up`, then the `export SLURM_CONF=...` line `slurmrl cluster status` prints; for " \
        "another cluster export SLURM_CONF=/path/to/its/slurm.conf\n"
    assert not job_dir.exists()
