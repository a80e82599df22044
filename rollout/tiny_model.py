"""A tiny random Qwen3 causal LM with a locally built tokenizer, in Hugging Face format.

The CPU engine, the tests and the demo serve it; the RL toy task trains it. Nothing comes from
a hub: the tokenizer is built with the `tokenizers` library from a fixed vocabulary of printable
ASCII characters (so every digit is one token), a few whole words and Qwen's special tokens.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK = "<unk>"
SPECIAL_TOKENS = (EOS, IM_START, IM_END, UNK)
# Whole-word tokens for the chat roles and the toy task's verb, so prompts stay short.
WORDS = ("system", "user", "assistant", "repeat")
# Every printable ASCII character but the vertical tab, form feed and carriage return.
CHARS = tuple(c for c in string.printable if c not in "\x0b\x0c\r")

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MAX_POSITIONS = 1024


class TinyModelError(Exception):
    """The output folder cannot be used."""


def vocabulary() -> dict[str, int]:
    return {token: i for i, token in enumerate(SPECIAL_TOKENS + WORDS + CHARS)}


def build_tokenizer():
    """A word/char-level `tokenizers.Tokenizer`: known words first, then single characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token=UNK))
    pattern = "|".join(WORDS) + r"|[\s\S]"
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    # WordLevel's default decoder joins tokens with spaces; these tokens are pieces of one string.
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def write_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write config, safetensors weights, tokenizer and chat template to out_dir (new or empty)."""
    import torch
    import transformers

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TinyModelError(f"{out} already exists and is not an empty folder; pick a new one")
    vocab = vocabulary()
    config = transformers.Qwen3Config(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
        # transformers 5 moves the legacy rope_theta into rope_parameters; 4.x (pyproject allows
        # >= 4.50) knows only rope_theta, so it is given as such.
        rope_theta=1000000.0,  # type: ignore[call-arg]
        # Larger than HF's 0.02 so logits spread well beyond float noise: greedy decoding then
        # does not flip between batch shapes, and sampling is far from uniform.
        initializer_range=0.1,
        bos_token_id=None, eos_token_id=vocab[EOS], pad_token_id=vocab[EOS], dtype="float32",
    )
    config.architectures = ["Qwen3ForCausalLM"]
    with torch.random.fork_rng(devices=[]):  # seed the weights without touching the caller's RNG
        torch.manual_seed(seed)
        model = transformers.Qwen3ForCausalLM(config).float()
    # A chat turn ends with <|im_end|>, a document with <|endoftext|>: stop on both, as Qwen does.
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=[vocab[IM_END], vocab[EOS]], pad_token_id=vocab[EOS])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS, "pad_token": EOS, "unk_token": UNK, "bos_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return out
