"""The megatron backend at TP=1, TP=2 and DP=2 (gloo processes; TP=2 also with the fused SDPA attention,
and with sequence parallelism over packs of odd length, padded to a multiple of TP; each layout with its
own micro-batching; one GPU a rank where there are two, else on CPU) on a tiny Qwen3 converted from HF:
packed log-probs equal HF's, one RL step gives the same loss and the same new weights in every
layout (so gradients, their reduction and clipping are right), and hf_weights gives back HF
tensors under HF names. dp2 runs the distributed optimizer (--use-distributed-optimizer, on by
default: each rank updates its share and broadcasts it), so dp2 == tp1 is its equivalence test."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers

from tests.rank_devices import rank_devices, start_ranks
from tests.rollout.servers import free_port
from trainer.args import build_config, build_parser
from trainer.batch import TrainSample
from trainer.losses import LossConfig
from trainer.old_actor import OldActor
from trainer.rl_step import make_pack_loss, make_value_pack_loss

ATOL = 1e-5
LENGTHS = [(7, 3), (12, 5), (5, 1), (9, 4), (15, 6), (6, 2)]  # (total tokens, response tokens)


def _samples(vocab: int) -> list[TrainSample]:
    g = torch.Generator().manual_seed(3)
    out = []
    for total, response in LENGTHS:
        out.append(TrainSample(tokens=torch.randint(0, vocab, (total,), generator=g), response_length=response,
                               loss_mask=torch.ones(response), reward=0.0, group_index=len(out),
                               advantages=torch.randn(response, generator=g)))
    return out


# Micro-batching differs by layout, so the layouts' agreement also shows the step does not depend
# on it: slime's default (one sample per micro-batch) at TP=1, packs of at most 24 tokens at TP=2,
# and at DP=2 those packs handed to the two ranks by Karmarkar-Karp.
PACKED = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "24"]
BATCHING = {(1, 1): [], (2, 2): PACKED, (1, 2): [*PACKED, "--balance-data"], (2, 4): PACKED, (1, 4): PACKED}


Layout = tuple[str, int, str, list[str]]  # name, TP, attention backend, more flags
ModelAndCkpt = tuple[Path, Path]  # an HF model and its torch_dist checkpoint


def _worker(rank: int, world: int, port: int, layouts: list[tuple[Layout, ModelAndCkpt]], out: Path) -> None:
    """Each layout (of its own model) in turn, in the same processes (megatron's groups made again
    for each): a spawn and megatron's import are most of a layout's time on CPU."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from megatron.core import parallel_state  # megatron: only in the workers

    from trainer import dist_env

    for (name, tp, attention, extra), (model, ckpt) in layouts:
        _layout(rank, world, name, tp, attention, extra, model, ckpt, out)
        parallel_state.destroy_model_parallel()
    dist_env.shutdown()


def _layout(rank: int, world: int, name: str, tp: int, attention: str, extra: list[str], model: Path, ckpt: Path,
            out: Path) -> None:
    from trainer.megatron.backend import MegatronBackend

    args = build_parser().parse_args([
        "--hf-checkpoint", str(model), "--num-rollout", "1", "--n-samples-per-prompt", "2", "--debug-train-only",
        "--load-debug-rollout-data", "unused/{rollout_id}", "--tensor-model-parallel-size", str(tp),
        "--attention-backend", attention, "--lr", "1e-2", "--clip-grad", "0.5", *BATCHING[(tp, world)],
        # Adam's first step is about lr * sign(g): float noise in a near-zero gradient element would
        # flip it. With eps = 1 the update follows the gradient, so layouts can be compared.
        "--adam-eps", "1", *extra])
    args = build_config(args)
    backend = MegatronBackend(args, json.loads((model / "config.json").read_text()))
    backend.load(ckpt, weights_only=True)
    before = {name: t.clone() for name, t in backend.hf_weights()}  # they may share the live model's memory
    optimizer = backend.actor.optimizer
    masters_before = [m.detach().clone() for m in optimizer.masters]
    samples = _samples(backend.shape.vocab_size)
    ids = list(range(len(samples)))
    logps = backend.log_probs(samples, ids, with_entropy=True)
    old_actor = OldActor(backend, max_staleness=1)  # --keep-old-actor: version 0 generated the samples
    old_actor.published(0)
    for i, s in enumerate(samples):
        s.old_log_probs = logps[i][0] + (0.3 if i % 2 else -0.3)  # off-policy enough that clipping matters
    metrics = backend.train_step(samples, ids, make_pack_loss(LossConfig(), samples, ids), need_entropy=False)
    weights = dict(backend.hf_weights())
    for s in samples:
        s.weight_version = 0
    kept = old_actor.log_probs(samples, ids, current=1)
    after = backend.log_probs(samples, ids)  # by the step's weights
    restored = all(torch.equal(t, weights[n]) for n, t in backend.hf_weights())
    names = {id(p): n for n, p in backend.model.named_parameters()}
    # fp32 master weights that the step left as they were (a bf16 weight may round back to itself)
    unmoved = [names[id(p)] for p, m, b in zip(optimizer.owned, optimizer.masters, masters_before) if torch.equal(m, b)]
    critic = _critic_step(backend, samples, ids) if backend.critic is not None else None
    if rank == 0:
        torch.save({"before": before, "logps": logps, "metrics": metrics, "weights": weights, "critic": critic,
                    "unmoved_masters": unmoved, "old_actor": {"logps": kept, "restored": restored, "after": after}},
                   out / f"result_{name}.pt")


def _critic_step(backend, samples: list[TrainSample], ids: list[int]) -> dict:
    """PPO's critic: one step toward random returns, then its values (under SP its value head
    gathers the sequence)."""
    g = torch.Generator().manual_seed(5)
    for i, s in enumerate(samples):
        s.values = backend.values(samples, ids)[i]
        s.returns = torch.randn(s.response_length, generator=g)
    metrics = backend.train_step(samples, ids, make_value_pack_loss(0.2, False, samples, ids), need_entropy=False,
                                 role="critic")
    return {"metrics": metrics, "values": backend.values(samples, ids)}


def _run_layouts(tmp_path: Path, world: int, layouts: list[tuple[Layout, ModelAndCkpt]]) -> dict:
    """Run `layouts` (of `world` ranks each, each of its model) one after another in one spawn; their
    results by name."""
    start_ranks(_worker, (world, free_port(), layouts, tmp_path), world)
    return {name: torch.load(tmp_path / f"result_{name}.pt", map_location="cpu") for (name, *_), _ in layouts}


def _run(tiny_megatron: tuple[Path, Path], tmp_path: Path, name: str, tp: int, world: int, attention: str,
         extra: list[str]) -> dict:
    return _run_layouts(tmp_path, world, [((name, tp, attention, extra), tiny_megatron)])[name]


def run_all(model_and_ckpt: ModelAndCkpt, tmp_path: Path,
            layouts: dict[str, tuple[int, int, str, list[str]]]) -> dict[str, dict]:
    """Each layout (name: TP, world, attention, flags) run, those of one world size in one spawn."""
    return run_all_models(tmp_path, {name: (model_and_ckpt, *layout) for name, layout in layouts.items()})


def run_all_models(tmp_path: Path,
                   layouts: dict[str, tuple[ModelAndCkpt, int, int, str, list[str]]]) -> dict[str, dict]:
    """Each layout (name: model, TP, world, attention, flags) run, those of one world size in one
    spawn whatever their models."""
    worlds = sorted({world for _, _, world, *_ in layouts.values()})
    return {name: result for world in worlds for name, result in _run_layouts(tmp_path, world, [
        ((n, tp, att, extra), model) for n, (model, tp, w, att, extra) in layouts.items() if w == world]).items()}


def _hf_logps(model_dir: Path, samples: list[TrainSample]) -> list[torch.Tensor]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            logits = hf(s.tokens[None]).logits[0, :-1]
            logp = torch.log_softmax(logits, -1).gather(-1, s.tokens[1:, None]).squeeze(-1)
            out.append(logp[-s.response_length:])
    return out


@pytest.fixture(scope="module")
def results(tiny_megatron, tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("runs")
    sp = ["--sequence-parallel"]
    ppo = ["--advantage-estimator", "ppo"]  # adds the critic
    layouts = {"tp1": (1, 1, "local", ppo), "tp2": (2, 2, "local", []), "dp2": (1, 2, "local", []),
               # the gradient sum in buckets launched during the backward (trainer.grad_buckets), with the critic's
               "dp2_overlap": (1, 2, "local", [*ppo, "--overlap-grad-reduce", "--ddp-bucket-size", "3000"]),
               "tp2_sdpa": (2, 2, "sdpa", []), "tp2_sp": (2, 2, "local", sp), "tp2_sp_sdpa": (2, 2, "sdpa", sp + ppo),
               "tp1_sp": (1, 1, "local", sp),  # SP at TP 1 is accepted and does nothing, as in Megatron-LM
               "tp2_sp_compiled": (2, 2, "sdpa", [*sp, "--torch-compile"]),
               # log-probs 3 response tokens at a time: vocab-parallel chunks, recomputed in the backward pass
               "tp2_chunked": (2, 2, "local", ["--log-probs-chunk-size", "3"])}
    with rank_devices(2):  # every layout on the same device
        return run_all(tiny_megatron, tmp, layouts)


def test_packed_log_probs_equal_hf(tiny_megatron, results) -> None:
    model, _ = tiny_megatron
    expected = _hf_logps(model, _samples(json.loads((model / "config.json").read_text())["vocab_size"]))
    for name, result in results.items():
        for i, want in enumerate(expected):
            got = result["logps"][i][0]
            assert got.shape == want.shape
            assert (got - want).abs().max() < ATOL, f"{name}: sample {i} log-probs differ from HF's"


SWAP_NOISE = 1e-5  # fp32 log-probs of one model by two compiled graphs


def test_keep_old_actor_takes_the_published_weights_in_every_layout(results) -> None:
    """--keep-old-actor's swap of each rank's shards (TP, SP, DP, compiled): after a step, the
    log-probs by version 0's weights are the ones taken before it, and the live weights come back.
    Equal to float noise, not bit for bit: on a GPU, a compiled model's forward after the step may be
    another compiled graph (dynamic shapes once the step's packs came) that sums in another order."""
    for name, result in results.items():
        kept, before, after = result["old_actor"]["logps"], result["logps"], result["old_actor"]["after"]
        assert all((kept[i][0] - before[i][0]).abs().max() <= SWAP_NOISE for i in before), name
        moved = max((after[i][0] - before[i][0]).abs().max().item() for i in before)
        assert moved > 100 * SWAP_NOISE, f"{name}: the step moved the log-probs by {moved}: no test of the swap"
        assert result["old_actor"]["restored"], f"{name}: the live weights did not come back"


def test_one_step_is_the_same_in_every_layout(results) -> None:
    base = results["tp1"]
    assert base["metrics"]["clipfrac"] > 0 and base["metrics"]["grad_norm"] > 0.5, "the step must clip to be a test"
    for name in ("tp2", "dp2", "dp2_overlap", "tp2_sdpa", "tp2_sp", "tp2_sp_sdpa", "tp1_sp", "tp2_sp_compiled", "tp2_chunked"):
        other = results[name]
        for key in ("loss", "pg_loss", "clipfrac", "grad_norm"):
            # relative as well: grad_norm is ~10 (on a GPU, compiled, 1e-6 relative apart)
            assert other["metrics"][key] == pytest.approx(base["metrics"][key], abs=ATOL, rel=ATOL), f"{name}: {key}"
        for hf_name, tensor in base["weights"].items():
            assert (other["weights"][hf_name] - tensor).abs().max() < ATOL, f"{name}: {hf_name} after the step"


def test_hf_weights_have_hf_names_and_changed(tiny_megatron, results) -> None:
    model, _ = tiny_megatron
    from safetensors.torch import load_file

    initial = load_file(model / "model.safetensors")
    for name, result in results.items():
        assert result["before"].keys() == initial.keys()
        for key, tensor in initial.items():
            assert torch.equal(result["before"][key], tensor), f"{name}: {key} does not round-trip"
    after = results["tp2"]["weights"]
    assert set(after) == set(initial)
    for name, tensor in initial.items():
        assert after[name].shape == tensor.shape and after[name].dtype == tensor.dtype, name
    changed = [n for n in initial if not torch.equal(after[n], initial[n])]
    assert len(changed) == len(initial), f"a step should move every tensor; unchanged: {set(initial) - set(changed)}"


@pytest.mark.parametrize("layout", ["tp2_sp_sdpa", "dp2_overlap"])
def test_the_critic_under_sequence_parallelism_and_data_parallelism_equals_tp1(results, layout: str) -> None:
    base, other = results["tp1"]["critic"], results[layout]["critic"]
    assert base["metrics"]["value_loss"] > 0
    for key in ("value_loss", "grad_norm"):
        assert other["metrics"][key] == pytest.approx(base["metrics"][key], abs=ATOL), key
    for i, values in base["values"].items():
        assert values.abs().max() > 1e-3, "the critic step must move the values to be a test"
        assert (other["values"][i] - values).abs().max() < ATOL, f"sample {i}: values after the critic step"
