"""slime's trainer extension points, each with its effect (main refused every one of them):
--custom-loss-function-path, --custom-tis-function-path (and --get-mismatch-metrics),
--custom-pg-loss-reducer-function-path, --custom-advantage-function-path,
--rollout-data-postprocess-path, --custom-reward-post-process-path,
--custom-convert-samples-to-train-data-path, --buffer-filter-path; and SFT as slime runs it
(--num-epoch, --disable-compute-advantages-and-returns, --debug-train-only with the SFT rollout)."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from torch import Tensor

from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.sample import Sample, Status
from rollout.tiny_model import write_tiny_model
from tests.trainer import slime_train_plugins as plugins
from tests.trainer.test_loop_parts import FakeBackend
from trainer import rl_step
from trainer.args import ArgsError, parse_args
from trainer.batch import Pack, TrainSample
from trainer.losses import LossConfig, token_losses
from trainer.phase_memory import PhaseMemory
from trainer.profiling import TrainProfiler
from trainer.slime_loss import SlimeLossPlugins, make_slime_pack_loss
from trainer.train_data import TrainData
from trainer.train_step import TrainPlugins, TrainStep, TrainStepConfig

LENGTHS = (3, 1, 4)  # response tokens of the micro-batch's samples
ARGS = Namespace(tis_clip=2.0, tis_clip_low=0.0)


def _samples() -> list[TrainSample]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for k, r in enumerate(LENGTHS):
        out.append(TrainSample(
            tokens=torch.arange(r + 2), response_length=r, loss_mask=torch.tensor([1.0] * (r - 1) + [float(k != 1)]),
            reward=float(k), group_index=0, rollout_log_probs=-torch.rand(r, generator=gen),
            old_log_probs=-torch.rand(r, generator=gen), ref_log_probs=-torch.rand(r, generator=gen),
            advantages=torch.randn(r, generator=gen)))
    return out


def _run(pack_loss, samples: list[TrainSample], logp_seed: int = 1) -> tuple[Tensor, dict, list[Tensor]]:
    gen = torch.Generator().manual_seed(logp_seed)
    logps = [(-torch.rand(s.response_length, generator=gen)).requires_grad_() for s in samples]
    entropies = [torch.rand(s.response_length, generator=gen) for s in samples]
    pack = Pack(list(range(len(samples))), torch.arange(sum(s.tokens.numel() for s in samples)),
                torch.tensor([0, 5, 8, 14], dtype=torch.int32))
    value, metrics = pack_loss(pack, logps, entropies)
    value.backward()
    return value, metrics, [lp.grad for lp in logps]


@pytest.mark.parametrize("per_token", [False, True])
def test_the_slime_shaped_loss_is_slurmrls_own(per_token: bool) -> None:
    """With slime's default TIS and reducer, the slime-shaped path (what the loss plug-ins plug into)
    gives slurmrl's loss, metrics and gradient: the two scales agree."""
    cfg = LossConfig(eps_clip=0.2, eps_clip_high=0.3, entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                     kl_loss_type="low_var_kl", use_tis=True, per_token_loss=per_token)
    samples, ids = _samples(), [0, 1, 2]
    ours = _run(rl_step.make_pack_loss(cfg, samples, ids), samples)
    slimes = _run(make_slime_pack_loss(cfg, SlimeLossPlugins(ARGS, None, None, None, False), samples, ids), samples)
    torch.testing.assert_close(slimes[0], ours[0])
    for a, b in zip(slimes[2], ours[2]):
        torch.testing.assert_close(a, b)
    for name in ("pg_loss", "clipfrac", "approx_kl", "entropy", "kl_loss"):
        torch.testing.assert_close(slimes[1][name], ours[1][name], msg=name)


def test_a_custom_tis_reweights_and_rejects_tokens() -> None:
    cfg = LossConfig(eps_clip=0.2, use_tis=True)
    samples = _samples()
    value, metrics, _ = _run(make_slime_pack_loss(cfg, SlimeLossPlugins(
        ARGS, None, plugins.reject_second_token, None, False), samples, [0, 1, 2]), samples)
    gen = torch.Generator().manual_seed(1)
    expected = 0.0
    for s in samples:
        logp = -torch.rand(s.response_length, generator=gen)
        losses, _, _ = token_losses(logp[None], s.old_log_probs[None], s.advantages[None], s.loss_mask[None], 0.2)
        kept = s.loss_mask.clone()
        kept[1:2] = 0  # rejected from the numerator; the denominator stays the sample's mask
        expected += float((2 * losses[0] * kept).sum() / s.loss_mask.sum().clamp(min=1))
    assert float(value.detach()) == pytest.approx(expected / 3, rel=1e-6)
    assert "rejected" in metrics and "ois" in metrics


def test_a_custom_pg_loss_reducer_reduces_the_policy_loss() -> None:
    cfg = LossConfig(eps_clip=0.2)
    samples = _samples()
    value, _, _ = _run(make_slime_pack_loss(cfg, SlimeLossPlugins(ARGS, None, None, plugins.token_sum_reducer, False),
                                            samples, [0, 1, 2]), samples)
    gen = torch.Generator().manual_seed(1)
    total = 0.0
    for s in samples:
        logp = -torch.rand(s.response_length, generator=gen)
        losses, _, _ = token_losses(logp[None], s.old_log_probs[None], s.advantages[None], s.loss_mask[None], 0.2)
        total += float((losses[0] * s.loss_mask).sum())
    assert float(value.detach()) == pytest.approx(total / 3, rel=1e-6)  # slime's scale, over the 3 samples of the batch


def test_slimes_own_sft_loss_as_a_custom_loss_is_the_sft_loss() -> None:
    samples, ids = _samples(), [0, 1, 2]
    custom = _run(make_slime_pack_loss(LossConfig(), SlimeLossPlugins(ARGS, plugins.sft_as_custom_loss, None, None,
                                                                      False), samples, ids), samples)
    sft = _run(rl_step.make_pack_loss(LossConfig(sft=True), samples, ids), samples)
    torch.testing.assert_close(custom[0], sft[0])
    for a, b in zip(custom[2], sft[2]):
        torch.testing.assert_close(a, b)


class CountingBackend(FakeBackend):
    def __init__(self) -> None:
        super().__init__()
        self.log_prob_passes = 0

    def log_probs(self, samples, ids, model="actor", with_entropy=False):
        self.log_prob_passes += 1
        return super().log_probs(samples, ids, model, with_entropy)


def _step(backend: FakeBackend, train_plugins: TrainPlugins) -> TrainStep:
    return TrainStep(backend, TrainStepConfig(
        global_batch_size=3, need_entropy=False, on_policy_tolerance=None, ref_model=False, teacher=False,
        critic=False, value_clip=0.2, per_token_loss=False), LossConfig(), lambda samples: None, TrainProfiler(0),
        lambda phase, rollout_id: None, PhaseMemory(None), train_plugins)


def test_a_custom_advantage_and_a_data_postprocess_set_what_is_trained() -> None:
    samples = [TrainSample(tokens=torch.arange(5), response_length=2, loss_mask=torch.ones(2), reward=float(k),
                           group_index=0) for k in range(3)]
    step = _step(FakeBackend(), TrainPlugins(Namespace(), True, plugins.reward_as_advantage, plugins.mask_first_token))
    step.prepare(samples, rollout_id=4)
    assert [s.advantages.tolist() for s in samples] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    assert [s.returns.tolist() for s in samples] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    assert [s.loss_mask.tolist() for s in samples] == [[0.0, 1.0]] * 3


def test_disable_compute_advantages_skips_the_log_prob_passes() -> None:
    backend = CountingBackend()
    samples = [TrainSample(tokens=torch.arange(5), response_length=2, loss_mask=torch.ones(2), reward=0.0,
                           group_index=k) for k in range(3)]
    _step(backend, TrainPlugins(compute_advantages=False)).run(0, samples)
    assert backend.log_prob_passes == 0 and len(backend.steps) == 1
    _step(backend, TrainPlugins()).run(1, samples)
    assert backend.log_prob_passes == 1


def _rollout() -> list[list[Sample]]:
    groups = []
    for g in range(2):
        group = []
        for k in range(2):
            s = Sample(index=2 * g + k, group_index=g, prompt="p", tokens=[1, 2, 3], response_length=1, loss_mask=[1],
                       reward={"score": float(k)}, status=Status.COMPLETED)
            group.append(s)
        groups.append(group)
    return groups


def test_a_reward_post_process_and_a_conversion_give_the_rewards_trained_on() -> None:
    args = Namespace(reward_key="score")
    post = TrainData("score", args, plugins.tenfold_rewards, "x.tenfold").of(_rollout())
    assert [[s.reward for s in g] for g in post] == [[0.0, 10.0], [0.0, 10.0]]
    assert [[s.raw_reward for s in g] for g in post] == [[0.0, 1.0], [0.0, 1.0]]
    converted = TrainData("score", args, convert=plugins.to_train_data, convert_path="x.convert").of(_rollout())
    assert [s.reward for g in converted for s in g] == [-1.0] * 4
    assert [s.group_index for g in converted for s in g] == [0, 0, 1, 1]


def test_a_buffer_filter_picks_the_given_back_groups(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input": f"q{i}"}) + "\n" for i in range(6)))
    buffer = DataBuffer(JsonlDataSource(data, shuffle=False), plugins.take_last, Namespace(), "x.take_last")
    given_back = buffer.get_samples(3)
    buffer.add_samples(given_back)
    assert [g[0].prompt for g in buffer.get_samples(2)] == ["q2", "q1"]  # the filter's choice, out of the buffer
    assert [g[0].prompt for g in buffer.get_samples(2)] == ["q0", "q3"]  # the rest, then fresh prompts


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _sft_argv(model: Path, data: Path, *flags: str) -> list[str]:
    return ["--hf-checkpoint", str(model), "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
            "--prompt-data", str(data), "--input-key", "messages", "--rollout-batch-size", "2", "--loss-type",
            "sft_loss", "--disable-compute-advantages-and-returns", "--debug-train-only", *flags]


def test_sft_as_slimes_retool_script_configures_it(model: Path, tmp_path: Path) -> None:
    """retool_qwen3_4b_sft.sh's SFT flags: --num-epoch 3 over 5 conversations, 2 a rollout, gives
    3 x 2 rollouts; no engines (--debug-train-only with the SFT rollout), no advantages."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"{i}"}]}) + "\n" for i in range(5)))
    config = parse_args(_sft_argv(model, data, "--num-epoch", "3"))
    assert config.run.num_rollout == 6 and config.run.debug_train_only
    assert not config.loss.compute_advantages_and_returns
    with pytest.raises(ArgsError, match="give --num-rollout N, or --num-epoch N with --prompt-data"):
        parse_args(_sft_argv(model, data))


@pytest.mark.parametrize("flags, message", [
    (["--loss-type", "custom_loss"], "--loss-type custom_loss and --custom-loss-function-path go together"),
    (["--custom-tis-function-path", "m.f"], "--custom-tis-function-path has no effect without --use-tis"),
    (["--disable-compute-advantages-and-returns"], "the policy loss needs advantages"),
    (["--debug-train-only"], "--debug-train-only needs --load-debug-rollout-data"),
])
def test_plugin_flags_that_cannot_act_are_refused(model: Path, flags: list[str], message: str) -> None:
    with pytest.raises(ArgsError, match=message):
        parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1", "--prompt-data", str(model / "config.json"),
                    "--engine-urls", "http://x", *flags])
