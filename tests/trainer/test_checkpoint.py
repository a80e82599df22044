"""Trainer checkpoints: exact resume of a megatron-core model, AdamW and RNG at TP=1 and TP=2; no
half-written checkpoint ever visible; damaged checkpoints skipped with a warning, or a clear error
when asked for by --ckpt-step; a checkpoint converted from HF loads as weights."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core import parallel_state, tensor_parallel

from ckpt_tools.convert import hf_to_torch_dist
from ckpt_tools.megatron_model import (
    build_gpt_model,
    destroy_parallel,
    init_parallel,
    load_torch_dist,
)
from ckpt_tools.torch_dist import Chunk, write_chunks, write_megatron_files
from ckpt_tools.tracker import TRACKER
from tests.ckpt_tools.tiny_hf import _COMMON, make_tiny_hf
from tests.rank_devices import init_rank, rank_devices, start_ranks
from trainer import checkpoint
from trainer.checkpoint import MANIFEST, CheckpointError, find_loadable
from trainer.megatron.state import _rng_states, holds_optimizer, load_megatron, save_megatron

# Attention dropout draws from megatron's model-parallel RNG tracker: a resume that lost the
# tracker's state would train differently.
HF_CONFIG = {**_COMMON, "architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": False,
             "attention_dropout": 0.1}
VOCAB = HF_CONFIG["vocab_size"]


# ---- a small training loop over every RNG a checkpoint restores --------------------------------

def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _new_run(seed: int, tp: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    _seed_all(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = build_gpt_model(HF_CONFIG, tp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """One step on a batch drawn from python, numpy and torch RNGs (the same on every TP rank)."""
    ids = (torch.randint(0, VOCAB, (2, 9)) + random.randrange(VOCAB) + int(np.random.randint(VOCAB))) % VOCAB
    ids = ids.to(next(model.parameters()).device)  # drawn on the CPU, run where the model is
    tokens, labels = ids[:, :-1], ids[:, 1:]
    seq = tokens.shape[1]
    positions = torch.arange(seq, device=ids.device).expand_as(tokens)
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=ids.device), diagonal=1)[None, None]
    model.train()
    loss = model(tokens, positions, causal, labels=labels).float().mean()
    loss.backward()
    _sum_qk_norm_grads_over_tp(model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _sum_qk_norm_grads_over_tp(model: torch.nn.Module) -> None:
    """q/k layernorms act on this rank's heads only: their TP replicas need the summed gradient
    (megatron's finalize_model_grads does this), else the replicas drift apart."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return
    for name, param in model.named_parameters():
        if "q_layernorm" in name or "k_layernorm" in name:
            torch.distributed.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)},
        "optimizer": {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(optimizer.state.values())},
        "rng": _rng_states(),
    }


def _assert_same(a: object, b: object, where: str = "") -> None:
    """Bit-exact equality through nested dicts, lists, tuples, tensors and arrays."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} vs {sorted(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _resume_scenario(save_dir: Path, tp: int) -> None:
    """Train 2 steps, save, train a 3rd; then a fresh run (other seed, other state) loads the
    checkpoint: everything saved comes back bit-exactly and its 3rd step is the same step."""
    model, optimizer = _new_run(seed=0, tp=tp)
    for _ in range(2):
        _train_step(model, optimizer)
    checkpoint.save(save_dir, 2, lambda tmp: save_megatron(tmp, model, optimizer, {"rollout_id": 2}))
    saved = _snapshot(model, optimizer)
    loss = _train_step(model, optimizer)
    after = _snapshot(model, optimizer)["params"]

    resumed, resumed_optimizer = _new_run(seed=7, tp=tp)
    _train_step(resumed, resumed_optimizer)  # existing state must be overwritten, not merged
    common = load_megatron(find_loadable(save_dir), resumed, resumed_optimizer)
    assert common == {"rollout_id": 2}
    _assert_same(_snapshot(resumed, resumed_optimizer), saved, "restored")
    assert _train_step(resumed, resumed_optimizer) == loss
    _assert_same(_snapshot(resumed, resumed_optimizer)["params"], after, "params after the step")


# ---- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lone_process_group():
    init_parallel(tp=1)
    yield
    destroy_parallel()


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, lone_process_group) -> Path:
    """A save folder with megatron checkpoints at iterations 2 and 4 (tracker at 4)."""
    save_dir = tmp_path_factory.mktemp("two") / "save"
    model, optimizer = _new_run(seed=0, tp=1)
    for iteration in (2, 4):
        _train_step(model, optimizer)
        checkpoint.save(save_dir, iteration,
                        lambda tmp, i=iteration: save_megatron(tmp, model, optimizer, {"rollout_id": i}))
    return save_dir


@pytest.fixture
def save_dir(two_checkpoints: Path, tmp_path: Path) -> Path:
    """A private copy of two_checkpoints to damage."""
    return Path(shutil.copytree(two_checkpoints, tmp_path / "save"))


def _tiny_write(value: int) -> Callable[[Path], None]:
    """A small torch_dist folder written without megatron, for the folder mechanics."""
    def write(folder: Path) -> None:
        chunk = Chunk("x", (4,), (0,), (4,), torch.float32, lambda: torch.full((4,), float(value)))
        write_chunks(folder, [chunk], {}, threads=1)
        write_megatron_files(folder, {"value": value})
    return write


def _value(folder: Path) -> int:
    return torch.load(folder / "common.pt", weights_only=False)["value"]


def _listing(save_dir: Path) -> dict[str, object]:
    return {p.name: (p.read_text() if p.is_file() else sorted(c.name for c in p.iterdir()))
            for p in sorted(save_dir.iterdir())}


# ---- exact resume ------------------------------------------------------------------------------

def test_resume_is_exact_tp1(tmp_path: Path, lone_process_group) -> None:
    _resume_scenario(tmp_path / "save", tp=1)


def _tp2_worker(rank: int, init_file: str, save_dir: Path) -> None:
    init_rank(rank, 2, init_file)
    init_parallel(tp=2)
    _resume_scenario(save_dir, tp=2)
    destroy_parallel()


def test_resume_is_exact_tp2(tmp_path: Path, lone_process_group, caplog) -> None:
    # start_ranks stops the other rank and raises (with the traceback) if one fails.
    with rank_devices(2):
        start_ranks(_tp2_worker, (str(tmp_path / "rendezvous"), tmp_path / "save"), 2)
    folder = tmp_path / "save" / "iter_0000002"
    assert {"__0_0.distcp", "__1_0.distcp"} <= json.loads((folder / MANIFEST).read_text())["files"].keys()
    # The TP=2 checkpoint resumes at TP=1: model and optimizer reshard, RNG states cannot.
    model, optimizer = _new_run(seed=3, tp=1)
    with caplog.at_level(logging.WARNING, logger="trainer.megatron.state"):
        assert load_megatron(folder, model, optimizer) == {"rollout_id": 2}
    assert "no RNG states for this rank's (pp, tp, dp) position (0, 0, 0) in (1, 1, 1)" in caplog.text
    assert all(float(s["step"]) == 2 for s in optimizer.state.values())


def test_converted_hf_checkpoint_loads_as_weights(tmp_path: Path, lone_process_group) -> None:
    hf_dir = make_tiny_hf("qwen3", tmp_path / "hf", tied=False)
    converted = find_loadable(hf_to_torch_dist(hf_dir, tmp_path / "converted", progress=False).parent)
    assert converted.name == "iter_0000000"  # no manifest: checked by its DCP metadata
    release = hf_to_torch_dist(hf_dir, tmp_path / "release", iteration=None, progress=False)
    assert find_loadable(release.parent) == release
    model, expected = build_gpt_model(HF_CONFIG), build_gpt_model(HF_CONFIG)
    assert load_megatron(converted, model, None) == {}
    load_torch_dist(expected, converted)
    _assert_same(model.state_dict(), expected.state_dict(), "weights")
    with pytest.raises(RuntimeError, match="holds no optimizer state.*as weights only"):
        load_megatron(converted, model, torch.optim.AdamW(model.parameters()))
    tied = build_gpt_model({**HF_CONFIG, "tie_word_embeddings": True})
    with pytest.raises(RuntimeError, match=r"does not match the model: the model has no place for \['output_layer"):
        load_megatron(converted, tied, None)


def test_a_checkpoint_without_optimizer_state_restores_weights_rng_and_loop_state(
        tmp_path: Path, lone_process_group) -> None:
    """--no-save-optim's checkpoint (save_megatron without the optimizer): the weights, RNG and
    loop state come back; the optimizer is not in it."""
    model, optimizer = _new_run(seed=0, tp=1)
    _train_step(model, optimizer)
    checkpoint.save(tmp_path / "save", 1, lambda tmp: save_megatron(tmp, model, None, {"rollout_id": 1}))
    folder = find_loadable(tmp_path / "save")
    draw = torch.rand(3)
    assert not holds_optimizer(folder)
    resumed, resumed_optimizer = _new_run(seed=7, tp=1)
    assert load_megatron(folder, resumed, None, with_rng=True) == {"rollout_id": 1}
    assert torch.equal(torch.rand(3), draw)
    _assert_same(resumed.state_dict(), model.state_dict(), "weights")
    with pytest.raises(RuntimeError, match="holds no optimizer state"):
        load_megatron(folder, resumed, resumed_optimizer)


# ---- fallback from damaged checkpoints ---------------------------------------------------------

def _assert_falls_back(save_dir: Path, caplog, why: str) -> None:
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        folder = find_loadable(save_dir)
    assert folder == save_dir / "iter_0000002"
    assert any(why in r.getMessage() and r.getMessage().endswith("using iter_0000002") for r in caplog.records), \
        caplog.text


def test_truncated_distcp_falls_back(save_dir: Path, caplog, lone_process_group) -> None:
    distcp = save_dir / "iter_0000004" / "__0_0.distcp"
    size = distcp.stat().st_size
    os.truncate(distcp, size // 2)
    _assert_falls_back(save_dir, caplog, f"iter_0000004 is damaged (__0_0.distcp is {size // 2} bytes, "
                                         f"the manifest says {size})")
    model = build_gpt_model(HF_CONFIG)
    assert load_megatron(find_loadable(save_dir), model, torch.optim.AdamW(model.parameters())) == {"rollout_id": 2}


def test_truncated_distcp_without_manifest_falls_back(save_dir: Path, caplog) -> None:
    """Folders from ckpt_tools or Megatron-LM have no manifest: the DCP byte ranges catch it."""
    (save_dir / "iter_0000004" / MANIFEST).unlink()
    os.truncate(save_dir / "iter_0000004" / "__0_0.distcp", 100)
    _assert_falls_back(save_dir, caplog, "__0_0.distcp is 100 bytes, but")


def test_manifest_mismatch_falls_back(save_dir: Path, caplog) -> None:
    with open(save_dir / "iter_0000004" / "common.pt", "ab") as f:
        f.write(b"\0")  # still loads, still inside every DCP range: only the manifest sees it
    _assert_falls_back(save_dir, caplog, "common.pt is")


def test_tracker_to_missing_folder_falls_back(save_dir: Path, caplog) -> None:
    shutil.rmtree(save_dir / "iter_0000004")
    _assert_falls_back(save_dir, caplog, "iter_0000004 is damaged (the folder does not exist)")


def test_leftover_tmp_folder_is_ignored_then_removed(save_dir: Path) -> None:
    stale = save_dir / ".iter_0000006.tmp-crashed"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    assert find_loadable(save_dir) == save_dir / "iter_0000004"
    checkpoint.save(save_dir, 6, _tiny_write(6))
    assert not stale.exists()
    assert find_loadable(save_dir) == save_dir / "iter_0000006"


def test_ckpt_step_of_damaged_checkpoint_is_an_error(save_dir: Path) -> None:
    os.truncate(save_dir / "iter_0000002" / "__0_1.distcp", 0)
    with pytest.raises(CheckpointError, match=r"--ckpt-step 2: .*iter_0000002 is damaged \(__0_1.distcp is 0 bytes"):
        find_loadable(save_dir, ckpt_step=2)
    with pytest.raises(CheckpointError, match="--ckpt-step 3: .* does not exist .*iter_0000002, iter_0000004"):
        find_loadable(save_dir, ckpt_step=3)
    assert find_loadable(save_dir, ckpt_step=4) == save_dir / "iter_0000004"


def test_nothing_to_load(tmp_path: Path) -> None:
    assert find_loadable(tmp_path / "missing") is None
    assert find_loadable(tmp_path) is None


def test_every_checkpoint_damaged_is_an_error(save_dir: Path) -> None:
    for name in ("iter_0000002", "iter_0000004"):
        (save_dir / name / "common.pt").write_bytes(b"junk")
    with pytest.raises(CheckpointError, match="no intact checkpoint.*iter_0000004 is damaged.*iter_0000002 is damaged"):
        find_loadable(save_dir)


# ---- nothing visible before completion ---------------------------------------------------------

def test_failed_write_changes_nothing(tmp_path: Path) -> None:
    save_dir = tmp_path / "save"
    checkpoint.save(save_dir, 2, _tiny_write(2))
    before = _listing(save_dir)

    def crash(folder: Path) -> None:
        _tiny_write(3)(folder)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(save_dir, 3, crash)
    visible = {k: v for k, v in _listing(save_dir).items() if not k.startswith(".")}
    assert visible == before
    assert find_loadable(save_dir) == save_dir / "iter_0000002"


def test_crash_before_the_tracker_moves_keeps_the_previous(tmp_path: Path, monkeypatch) -> None:
    save_dir = tmp_path / "save"
    checkpoint.save(save_dir, 2, _tiny_write(2))

    def crash(*args) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "write_tracker", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(save_dir, 3, _tiny_write(3))
    assert (save_dir / TRACKER).read_text() == "2"
    assert find_loadable(save_dir) == save_dir / "iter_0000002"
    assert checkpoint.validate(save_dir / "iter_0000003") is None  # complete, merely not latest


def test_saving_an_iteration_again_replaces_it(tmp_path: Path) -> None:
    save_dir = tmp_path / "save"
    checkpoint.save(save_dir, 2, _tiny_write(1))
    checkpoint.save(save_dir, 2, _tiny_write(2))
    assert _value(find_loadable(save_dir)) == 2
    assert sorted(p.name for p in save_dir.iterdir()) == ["iter_0000002", TRACKER]


def test_keep_prunes_old_iterations(tmp_path: Path) -> None:
    save_dir = tmp_path / "save"
    for iteration in (1, 2, 3):
        checkpoint.save(save_dir, iteration, _tiny_write(iteration), keep=2)
    assert sorted(p.name for p in save_dir.glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    # Resumed from iteration 2 (--ckpt-step) and saved 2 again: the newer 3 the tracker named stays.
    (save_dir / TRACKER).write_text("3")
    checkpoint.save(save_dir, 2, _tiny_write(2), keep=1)
    assert sorted(p.name for p in save_dir.glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    assert find_loadable(save_dir) == save_dir / "iter_0000002"
