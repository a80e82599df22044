"""`slurmrl tiny-model`: a tiny Qwen3 model and a local tokenizer that transformers loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from jobs.cli import main as slurmrl
from rollout.tiny_model import write_tiny_model
from tests.rollout.cpu_engine_helpers import REPO


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    done = subprocess.run([sys.executable, "-m", "rollout", "tiny-model", str(out), "--seed", "3"], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote {out}"
    return out


def test_transformers_loads_model_and_tokenizer(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.float32
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.intermediate_size) == (2, 64, 4, 2, 16, 128)
    assert config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert config.vocab_size == len(tokenizer) <= 128
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == config.eos_token_id
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer.encode("repeat: 7")])).logits
    assert logits.shape[-1] == config.vocab_size and torch.isfinite(logits).all()


def test_tokenizer_vocabulary(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for digit in "0123456789":
        assert len(tokenizer.encode(digit)) == 1
    ids = tokenizer.encode("repeat: 12 + 345 = 357")
    assert tokenizer.convert_ids_to_tokens(ids)[:6] == ["repeat", ":", " ", "1", "2", " "]
    text = "abc xyz, 0-9! (ok) ABC?\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tokenizer.encode(special)) == 1
    assert tokenizer.decode(tokenizer.encode("<|im_start|>user<|im_end|>"), skip_special_tokens=True) == "user"


def test_chat_template_is_qwen_style(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "repeat: 7"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nrepeat: 7<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert '"chat_template"' in (model_dir / "tokenizer_config.json").read_text()


def test_seed_decides_the_weights(tmp_path: Path, model_dir: Path) -> None:
    again = load_file(write_tiny_model(tmp_path / "again", seed=3) / "model.safetensors")
    other = load_file(write_tiny_model(tmp_path / "other", seed=4) / "model.safetensors")
    first = load_file(model_dir / "model.safetensors")
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_refuses_a_non_empty_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    assert slurmrl(["tiny-model", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists and is not an empty folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert slurmrl(["tiny-model", str(empty), "--seed", "1"]) == 0
    assert (empty / "model.safetensors").is_file() and (empty / "tokenizer.json").is_file()
