"""slime's flags and values that main answered "unknown flag" or argparse's bare "invalid choice",
or refused though slurmrl does what they ask: each now takes its effect, is accepted as the no-op
it is here, or is refused with its reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_tools.architectures import BUILT_FAMILIES
from rollout.tiny_model import write_tiny_model
from trainer import rl_step
from trainer.args import ArgsError, build_parser, check_model_flags, parse_args
from trainer.batch import TrainSample
from trainer.config.device_checks import distributed_backend_problem, memory_history_problem
from trainer.memory_history import MemoryHistory
from trainer.profiling import TrainProfiler

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _argv(model: Path, *flags: str) -> list[str]:
    return ["--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt", "2", "--debug-train-only",
            "--load-debug-rollout-data", "x", *flags]


def test_cispo_trains_grpos_advantages_with_its_own_loss(model: Path) -> None:
    config = parse_args(_argv(model, "--advantage-estimator", "cispo", "--eps-clip", "1.0", "--eps-clip-high", "4.0"))
    assert rl_step.loss_config(config.loss).surrogate == "cispo"
    samples = [TrainSample(tokens=torch.arange(4), response_length=2, loss_mask=torch.ones(2), reward=r, group_index=0,
                           old_log_probs=torch.zeros(2)) for r in (1.0, 0.0)]
    rl_step.compute_advantages(config.loss, samples)
    assert [s.advantages.tolist() for s in samples] == [[pytest.approx(0.7071, abs=1e-4)] * 2,
                                                         [pytest.approx(-0.7071, abs=1e-4)] * 2]


def test_the_no_op_switches_are_accepted(model: Path) -> None:
    parse_args(_argv(model, "--no-rope-fusion", "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion",
                     "--enable-experimental"))


@pytest.mark.parametrize("flag, value, reason", [
    ("--moe-token-dispatcher-type", "flex", "flex: megatron's flex dispatcher runs on DeepEP or HybridEP"),
    ("--lr-decay-style", "WSD", "WSD: megatron's inverse-square-root and WSD schedules are not implemented"),
    ("--normalization", "LayerNorm", f"LayerNorm: slurmrl builds {BUILT_FAMILIES} models, all with RMSNorm"),
    ("--profile-target", "train_actor", "profile the trainer with `slurmrl profile JOB --train --steps N`"),
    ("--freeze-indexer", None, "the DSA indexer (DeepSeek sparse attention) is not in the models slurmrl builds"),
    ("--async-save", None, "checkpoints are written synchronously"),
])
def test_a_value_slurmrl_lacks_is_refused_with_its_reason(model: Path, flag: str, value: str | None,
                                                          reason: str) -> None:
    with pytest.raises(ArgsError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        parse_args(_argv(model, flag, *([value] if value else [])))


def _llama31(tmp_path: Path, model: Path) -> Path:
    """The tiny model with Llama 3.1's RoPE scaling in its config.json (transformers 5's rope_parameters)."""
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "llama3", "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192}
    folder = tmp_path / "llama31"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_rope_scaling_flags_are_checked_against_config_json(model: Path, tmp_path: Path) -> None:
    """slime's Llama 3.1 model script passes --use-rope-scaling --rotary-scaling-factor 8.0: accepted
    where config.json has that scaling (ckpt_tools builds it from there), refused where not."""
    scaled = _llama31(tmp_path, model)
    config = parse_args(_argv(model, "--use-rope-scaling", "--rotary-scaling-factor", "8.0"))
    with pytest.raises(ArgsError) as err:  # the tiny model has no rope scaling
        check_model_flags(config.shape, str(model), json.loads((model / "config.json").read_text()))
    assert "--use-rope-scaling True disagrees with" in str(err.value)
    assert "--rotary-scaling-factor 8.0 disagrees with" in str(err.value)
    check_model_flags(config.shape, str(scaled), json.loads((scaled / "config.json").read_text()))
    wrong = parse_args(_argv(model, "--use-rope-scaling", "--rotary-scaling-factor", "32.0")).shape
    with pytest.raises(ArgsError, match=r"--rotary-scaling-factor 32.0 disagrees with .*\(8.0\)"):
        check_model_flags(wrong, str(scaled), json.loads((scaled / "config.json").read_text()))


def test_padded_vocab_size_must_be_slurmrls_padding(model: Path) -> None:
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    padded = -(-vocab // 128) * 128
    parse_args(_argv(model, "--padded-vocab-size", str(padded)))
    with pytest.raises(ArgsError, match=f"--padded-vocab-size {padded + 128}: slurmrl's megatron backend pads "
                                        f"config.json's vocab_size {vocab} to {padded}"):
        parse_args(_argv(model, "--padded-vocab-size", str(padded + 128)))


def test_the_distributed_backend_and_timeout() -> None:
    assert distributed_backend_problem("gloo", "cpu") is None and distributed_backend_problem(None, "cuda") is None
    assert "NCCL needs GPUs" in (distributed_backend_problem("nccl", "cpu") or "")
    assert "need NCCL" in (distributed_backend_problem("gloo", "cuda") or "")
    code = ("import torch, torch.distributed as dist; from trainer import dist_env; dist_env.setup(); "
            "dist_env.init_process_group('gloo', 3); "
            "print(dist.group.WORLD._get_backend(torch.device('cpu')).options._timeout); dist_env.shutdown()")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC", "MASTER_", "RANK", "WORLD_SIZE"))}
    env["CUDA_VISIBLE_DEVICES"] = ""  # a trainer on the CPU, where gloo is the backend (on a GPU it is refused above)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "0:03:00"  # --distributed-timeout-minutes 3


class _FakeCudaMemory:
    """torch.cuda.memory's recording calls, noted (no GPU here)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def _record_memory_history(self, enabled: object = "all", **kwargs: object) -> None:
        self.calls.append(("record", enabled))

    def _dump_snapshot(self, path: str) -> None:
        Path(path).write_bytes(b"snapshot")
        self.calls.append(("dump", Path(path).name))


def test_record_memory_history_dumps_after_the_asked_rollout(tmp_path: Path) -> None:
    memory = _FakeCudaMemory()
    profiler = TrainProfiler(0, MemoryHistory(2, str(tmp_path / "snaps"), "snapshot.pickle", 2, memory=memory))
    for rollout_id in range(4):
        profiler.after_rollout(rollout_id)
    [snapshot] = (tmp_path / "snaps").iterdir()
    assert snapshot.name.startswith("memory_snapshot_time") and snapshot.name.endswith("_rank2_snapshot.pickle")
    assert memory.calls == [("record", "all"), ("dump", snapshot.name), ("record", None)]  # once, after rollout 1
    assert "it records the CUDA allocator's history and this trainer runs on cpu" in (
        memory_history_problem(True, "cpu") or "")


def test_every_refused_or_accepted_flag_keeps_a_reason() -> None:
    """The switches slurmrl accepts as no-ops say what slurmrl does instead (the flag table shows it)."""
    actions = {o: a for a in build_parser()._actions for o in a.option_strings}
    for flag in ("--no-rope-fusion", "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion",
                 "--enable-experimental"):
        assert actions[flag].allowed is True and actions[flag].reason.startswith("accepted: ")


def test_save_hf_writes_an_hf_checkpoint_with_each_save(model: Path, tmp_path: Path) -> None:
    """slime's --save-hf: with each checkpoint, the weights as an HF folder at the formatted path."""
    from safetensors.torch import load_file

    from tests.trainer.test_loop_parts import FakeBackend
    from trainer.checkpointer import CheckpointConfig, Checkpointer

    backend = FakeBackend()
    checkpointer = Checkpointer(backend, CheckpointConfig(
        save_dir=tmp_path / "save", load_dir=None, load_step=None, save_interval=1, keep=None, num_rollout=3,
        job_dir=None, save_hf=str(tmp_path / "hf" / "iter_{rollout_id}"), model_files=model), [], [],
        lambda phase, rollout_id: None)
    checkpointer.state_dict = lambda: {"rollout_id": 1}  # type: ignore[method-assign]
    backend.weight = torch.tensor([3.0, 4.0])
    checkpointer.save(1)
    folder = tmp_path / "hf" / "iter_1"
    assert torch.equal(load_file(folder / "model.safetensors")["w"], torch.tensor([3.0, 4.0]))
    assert json.loads((folder / "config.json").read_text()) == json.loads((model / "config.json").read_text())
    with pytest.raises(ArgsError, match="--save-hf writes an HF checkpoint with each save: give --save too"):
        parse_args(_argv(model, "--save-hf", str(tmp_path / "x_{rollout_id}")))
    # a multimodal checkpoint (Qwen3.5's): the trainer holds no vision tower to write
    multimodal = tmp_path / "Qwen3.5-stand-in"
    multimodal.mkdir()
    (multimodal / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"],
                                                        "text_config": json.loads((model / "config.json").read_text())}))
    with pytest.raises(ArgsError, match=r"--save-hf: .* is a Qwen3_5ForConditionalGeneration, whose vision tower "
                                        r"slurmrl does not train or save: convert a --save checkpoint with"):
        parse_args(_argv(multimodal, "--save", str(tmp_path / "s"), "--save-hf", str(tmp_path / "x_{rollout_id}")))


def test_quantized_rollout_weights_are_refused(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """slime's FP8/INT4 recipes: an --hf-checkpoint whose config.json asks the engines for quantized
    weights, and slime's INT4 fake-QAT switch, are refused with the reason (main accepted both and
    published unquantized weights)."""
    fp8 = tmp_path / "Qwen3-4B-FP8"
    fp8.mkdir()
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArgsError, match="config.json's quantization_config asks the engines for fp8 weights; "
                                        "slurmrl publishes the trainer's weights unquantized"):
        parse_args(_argv(fp8))
    monkeypatch.setenv("OPEN_TRAINING_INT4_FAKE_QAT_FLAG", "1")
    with pytest.raises(ArgsError, match="OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1: slime's INT4 fake quantization-aware "
                                        "training is not implemented"):
        parse_args(_argv(model))


def test_moe_layer_freq_takes_megatrons_expression() -> None:
    """slime's GLM-4.7 scripts give --moe-layer-freq [0]*1+[1]*46 (Megatron evaluates it): read, not
    refused as a bad value, as the per-layer list (printed in Megatron's short form); all MoE is 1."""
    from trainer.args_actions import moe_layer_freq

    assert (moe_layer_freq("[0]*1+[1]*46"), moe_layer_freq("[1]*48"), moe_layer_freq("[1, 1]")) == ([0] + [1] * 46, 1, 1)
    assert str(moe_layer_freq("[0, 0, 0, 1, 1]")) == "[0]*3+[1]*2"
    with pytest.raises(Exception, match="is not a list of 0/1"):
        moe_layer_freq("[__import__('os')]")
