"""Multi-token prediction (slime's --mtp-num-layers, --enable-mtp-training, --mtp-loss-scaling-factor)
on a tiny DeepSeek-V3 with one MTP layer (HF: decoder layer 3 with its norms, input projection and
copies of the embedding and head): trained, its loss joins the step and is logged as slime logs it,
its weights move, and the step is the same at TP=1, at TP=2 + SP with the experts over two ranks
(EP=2) and at DP=2; kept but not trained, its weights stay as loaded; either way the logits (log-probs) are
the decoder's alone, and publishing sends every HF tensor of the checkpoint, the MTP layer's too.
End to end (`python -m trainer` from --hf-checkpoint, a stand-in engine behind the real router): the
MTP loss falls over a few rollouts while each published version reaches the engine intact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckpt_tools.convert import hf_to_torch_dist
from ckpt_tools.torch_dist import read_metadata, tensor_entries
from ckpt_tools.tracker import resolve_checkpoint
from rollout.toy_task import write_toy_data
from tests.ckpt_tools.tiny_hf import make_tiny_hf, tiny_hf_with_tokenizer
from tests.rank_devices import rank_devices
from tests.rollout.servers import engines_behind_router
from tests.trainer.test_megatron_backend import ATOL, PACKED, _hf_logps, _samples, run_all
from tests.trainer.test_megatron_expert_bias_moe import FAMILIES, MOE_FLAGS
from tests.trainer.test_rl_loop import metrics, trainer

ARCH = "deepseek_v3_dense_first"
MTP = ["--mtp-num-layers", "1", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.5"]
MTP_LAYER = "model.layers.3."  # the tiny model has 3 decoder layers
# Packed alike at every layout: the MTP loss is a mean over micro-batches, as megatron's.
LAYOUTS = {
    "tp1": (1, 1, "local", [*PACKED, *MTP]),
    "tp2_sp_ep2": (2, 2, "local", [*MTP, "--sequence-parallel", "--expert-model-parallel-size", "2",
                                   "--expert-tensor-parallel-size", "1"]),
    # one sample per micro-batch (none holds two of at most 5 tokens), at DP=1 and DP=2
    "tp1_single": (1, 1, "local", [*PACKED, "--max-tokens-per-gpu", "5", *MTP]),
    "dp2": (1, 2, "local", ["--max-tokens-per-gpu", "5", *MTP]),
    "tp1_kept": (1, 1, "local", [*PACKED, "--mtp-num-layers", "1"]),  # kept, not trained
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mtp")
    model = make_tiny_hf(ARCH, root / "model", tied=False, mtp_layers=1)
    return model, hf_to_torch_dist(model, root / "torch_dist", iteration=None, mtp_layers=1, progress=False)


@pytest.fixture(scope="module")
def results(tiny, tmp_path_factory) -> dict[str, dict]:
    with rank_devices(2):
        return run_all(tiny, tmp_path_factory.mktemp("runs"), {
            name: (tp, world, attention, [*FAMILIES[ARCH], *MOE_FLAGS, *extra])
            for name, (tp, world, attention, extra) in LAYOUTS.items()})


def _mtp_names(weights: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in weights if name.startswith(MTP_LAYER)]


def test_trained_mtp_layer_moves_and_its_loss_is_logged(results) -> None:
    trained, kept = results["tp1"], results["tp1_kept"]
    assert trained["metrics"]["mtp_loss"] > 1.0, trained["metrics"]  # cross-entropy over a 128-token vocabulary
    assert trained["metrics"]["mtp_1_loss"] == pytest.approx(trained["metrics"]["mtp_loss"])
    assert "mtp_loss" not in kept["metrics"]
    names = _mtp_names(trained["weights"])
    assert len(names) > 10, names
    # The embedding and head copies follow the decoder's own (the MTP loss does not train the head).
    moved = {n for n in names if not torch.equal(trained["weights"][n], trained["before"][n])}
    assert {MTP_LAYER + "eh_proj.weight", MTP_LAYER + "enorm.weight", MTP_LAYER + "self_attn.kv_b_proj.weight",
            MTP_LAYER + "mlp.shared_experts.up_proj.weight"} <= moved, sorted(set(names) - moved)
    for name in names:
        if not name.endswith(("embed_tokens.weight", "shared_head.head.weight")):
            assert torch.equal(kept["weights"][name], kept["before"][name]), f"{name} moved without MTP training"
    assert torch.equal(trained["weights"][MTP_LAYER + "shared_head.head.weight"], trained["weights"]["lm_head.weight"])
    # megatron's MTP loss reaches the decoder beneath it through its hidden states
    last = "model.layers.2.self_attn.kv_b_proj.weight"
    assert not torch.equal(trained["weights"][last], kept["weights"][last])


@pytest.mark.parametrize(("layout", "baseline"), [("tp2_sp_ep2", "tp1"), ("dp2", "tp1_single")])
def test_the_step_is_the_same_at_tp2_sp_ep2_and_dp2(results, layout: str, baseline: str) -> None:
    """...the MTP loss a mean over the step's micro-batches, wherever they ran (as megatron's: so
    the micro-batches must be alike to compare)."""
    base, other = results[baseline], results[layout]
    for key in ("loss", "pg_loss", "mtp_loss", "grad_norm"):
        assert other["metrics"][key] == pytest.approx(base["metrics"][key], abs=ATOL), key
    for name, tensor in base["weights"].items():
        assert (other["weights"][name] - tensor).abs().max() < ATOL, f"{name} after the step"


def test_log_probs_are_the_decoders_and_every_hf_weight_is_published(tiny, results) -> None:
    model, _ = tiny
    expected = _hf_logps(model, _samples(json.loads((model / "config.json").read_text())["vocab_size"]))
    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    for name, result in results.items():
        for i, want in enumerate(expected):
            assert (result["logps"][i][0] - want).abs().max() < ATOL, f"{name}: sample {i}"
        assert set(result["weights"]) == stored, f"{name}: {set(result['weights']) ^ stored}"


def test_mtp_targets_stay_within_a_sample_and_its_response() -> None:
    """Layer k predicts the token k + 1 ahead; a prediction counts only where that token is a
    response token (weight = its loss mask) of the same sample."""
    from trainer.megatron.mtp import targets

    tokens, weights = torch.arange(10, 17), torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.5])
    (first, w1), (second, w2) = targets(tokens, weights, torch.tensor([0, 4, 7], dtype=torch.int32), layers=2)
    assert first.tolist() == [[12, 13, 14, 15, 16, 0, 0]] and w1.tolist() == [[1.0, 1.0, 0.0, 0.0, 0.5, 0.0, 0.0]]
    assert second.tolist() == [[13, 14, 15, 16, 0, 0, 0]] and w2.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize(("argv", "message"), [
    (["--enable-mtp-training"], "--enable-mtp-training needs --mtp-num-layers N"),
    (["--mtp-num-layers", "2"], "--mtp-num-layers 2: {model}/config.json has num_nextn_predict_layers 1"),
    (["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1"],
     "--mtp-loss-scaling-factor weighs the loss of --enable-mtp-training"),
    (["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"],
     "MTP layers under pipeline or context parallelism are not supported"),
    (["--mtp-num-layers", "1", "--train-backend", "fsdp"], "--mtp-num-layers 1 needs --train-backend megatron"),
])
def test_mtp_flags_are_checked(tiny, argv: list[str], message: str) -> None:
    from trainer.args import ArgsError, build_config, build_parser

    model, _ = tiny
    common = ["--hf-checkpoint", str(model), "--num-rollout", "1", "--debug-train-only", "--n-samples-per-prompt", "2",
              "--load-debug-rollout-data", "x"]
    with pytest.raises(ArgsError) as err:
        build_config(build_parser().parse_args([*common, *argv]))
    assert any(message.format(model=model) in line for line in err.value.problems), err.value.problems


def test_a_model_without_mtp_layers_is_named(tmp_path: Path) -> None:
    from trainer.args import ArgsError, build_config, build_parser

    model = make_tiny_hf("qwen3", tmp_path / "qwen", tied=False)
    with pytest.raises(ArgsError) as err:
        build_config(build_parser().parse_args(["--hf-checkpoint", str(model), "--num-rollout", "1",
                                                "--debug-train-only", "--n-samples-per-prompt", "2",
                                                "--load-debug-rollout-data", "x", "--mtp-num-layers", "1"]))
    assert any("is a Qwen3ForCausalLM, which has no multi-token prediction layers" in line
               for line in err.value.problems), err.value.problems


SAME_CPU = 1e-4  # the engine's log-probs against the trainer's, both fp32 on the CPU (~1e-6 apart)


def test_mtp_trains_in_the_rl_loop_and_every_version_reaches_the_engine(tmp_path: Path) -> None:
    model = tiny_hf_with_tokenizer(ARCH, tmp_path / "models", seed=0, mtp_layers=1)
    data = write_toy_data(tmp_path / "toy.jsonl", num_prompts=64)
    servers = tmp_path / "servers"
    servers.mkdir()
    with engines_behind_router(model, servers, count=1, deterministic=True) as (router, _):
        trainer((model, data), router, tmp_path / "job", "--num-rollout", "4", "--rollout-batch-size", "8",
                "--lr", "1e-2", "--train-backend", "megatron", "--update-weight-transport", "disk",
                *FAMILIES[ARCH], *MOE_FLAGS, *MTP, "--true-on-policy-mode", "--true-on-policy-tolerance", str(SAME_CPU),
                "--save", str(tmp_path / "ckpt"), "--save-interval", "4")
    rows = metrics(tmp_path / "job")
    assert [m["rollout_id"] for m in rows] == [0, 1, 2, 3]
    assert all(m["logp_mismatch_max"] < SAME_CPU and m["engines_updated"] == 1 for m in rows), rows
    assert rows[-1]["mtp_loss"] < rows[0]["mtp_loss"], [m["mtp_loss"] for m in rows]
    saved = tensor_entries(read_metadata(resolve_checkpoint(tmp_path / "ckpt")))
    assert "mtp.layers.0.eh_proj.weight" in saved and "mtp.layers.0.transformer_layer.mlp.router.expert_bias" in saved
