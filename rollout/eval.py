"""Eval: named prompt sets generated on the live engines between rollouts, scored, and reduced to
slime's metrics (slime/rollout/sglang_rollout.py eval_rollout, observability/rollout_metrics.py):

    eval/<name>                   mean reward
    eval/<name>-truncated_ratio   share of responses cut by the length limit
    eval/<name>-pass@<k>          k = 1, 2, 4, ... up to --n-samples-per-eval-prompt (reward 1 = pass)

Each set has its own sampling parameters (the --eval-* flags, falling back to the --rollout-*
ones) and goes through generate_rollout's request path. The sets run one after the other in the
order given; they read their own files from the start every time and never touch the training
data buffer, and every request's sampling seed is derived from (seed, rollout id, sample index),
so eval moves no training data and no training RNG.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout import debug_data
from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.generate import RolloutArgs, generate_rollout
from rollout.plugins import load_function
from rollout.sample import Sample, Status, group_positions

LEGACY_NAME = "aime"  # slime's name for a lone --eval-prompt-data PATH


class EvalConfigError(ValueError):
    """Bad eval flags; the message names the flag and the fix."""


@dataclass(frozen=True)
class EvalSet:
    """One eval set, by slime's EvalDatasetConfig names (an --eval-function-path plug-in reads
    them as args.eval_datasets)."""

    name: str
    path: str
    input_key: str
    label_key: str | None
    metadata_key: str | None
    n_samples_per_eval_prompt: int
    temperature: float
    top_p: float
    top_k: int
    max_response_len: int


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def eval_sets(args: Any) -> list[EvalSet]:
    """The sets of --eval-prompt-data NAME PATH [NAME PATH ...], each with its sampling parameters."""
    values = list(args.eval_prompt_data or [])
    if len(values) == 1:
        values = [LEGACY_NAME, values[0]]
    if len(values) % 2:
        raise EvalConfigError(f"--eval-prompt-data takes NAME PATH pairs, got {len(values)} values: {values}")
    names = values[0::2]
    if len(set(names)) != len(names):
        raise EvalConfigError(f"--eval-prompt-data: each set needs its own name, got {names}")
    sets = []
    for name, path in zip(names, values[1::2]):
        if not Path(path).is_file():
            raise EvalConfigError(f"--eval-prompt-data {name} {path}: no such file; give a jsonl file")
        sets.append(EvalSet(
            name=name, path=str(path), input_key=_first(args.eval_input_key, args.input_key),
            label_key=_first(args.eval_label_key, args.label_key), metadata_key=args.metadata_key,
            n_samples_per_eval_prompt=args.n_samples_per_eval_prompt,
            temperature=_first(args.eval_temperature, args.rollout_temperature),
            top_p=_first(args.eval_top_p, args.rollout_top_p), top_k=_first(args.eval_top_k, args.rollout_top_k),
            max_response_len=_first(args.eval_max_response_len, args.rollout_max_response_len)))
    return sets


def pass_at_k(rewards: list[float], group_index: list[int]) -> dict[str, float]:
    """slime's compute_pass_rate over groups of any size (each sample's group_index names its
    prompt): the unbiased pass@k estimate averaged over prompts, for k = 1, 2, 4, ... up to the
    smallest group, so every prompt has an estimate for every k; a response passes when its reward
    is 1. Nothing when a prompt has one sample."""
    groups = [[rewards[i] for i in positions] for positions in group_positions(group_index)]
    smallest = min(map(len, groups), default=1)
    if smallest == 1:
        return {}
    out = {}
    for k in (2**i for i in range(int(math.log2(smallest)) + 1)):
        estimates = []
        for group in groups:
            n, c = len(group), sum(1 for r in group if r == 1)
            estimates.append(1.0 if n - c < k else 1.0 - math.prod(1.0 - k / m for m in range(n - c + 1, n + 1)))
        out[f"pass@{k}"] = sum(estimates) / len(estimates)
    return out


def eval_metrics(data: dict[str, dict[str, Any]], group_size: int) -> dict[str, float]:
    """slime's log_eval_rollout_data numbers for `data` ({name: {"rewards", "truncated"?,
    "samples"?}}): pass@k groups by the samples' group_index; a plug-in's result without its
    samples is grouped as slime does, in runs of group_size (--n-samples-per-eval-prompt)."""
    out: dict[str, float] = {}
    for name, result in data.items():
        rewards = [float(r or 0.0) for r in result["rewards"]]
        out[f"eval/{name}"] = sum(rewards) / max(1, len(rewards))
        if "truncated" in result:
            out[f"eval/{name}-truncated_ratio"] = sum(map(bool, result["truncated"])) / max(1, len(result["truncated"]))
        samples = result.get("samples") or []
        groups = ([s.group_index for s in samples] if len(samples) == len(rewards)
                  else [i // group_size for i in range(len(rewards))])
        out.update({f"eval/{name}-{key}": value for key, value in pass_at_k(rewards, groups).items()})
    return out


class Evaluator:
    """Runs every eval set at a rollout id; `plugin_args` is what plug-ins get as args (the whole
    trainer flags, with eval_datasets)."""

    def __init__(self, rollout: RolloutArgs, sets: list[EvalSet], plugin_args: Any, *, tokenizer: Any = None,
                 apply_chat_template: bool = False, apply_chat_template_kwargs: dict[str, Any] | None = None,
                 eval_function_path: str | None = None,
                 log_function_path: str | None = None) -> None:
        self.rollout, self.sets, self.plugin_args = rollout, sets, plugin_args
        self.function = load_function(eval_function_path, "--eval-function-path") if eval_function_path else None
        self.log_function = (load_function(log_function_path, "--custom-eval-rollout-log-function-path")
                             if log_function_path else None)
        self.sources = {s.name: JsonlDataSource(
            s.path, input_key=s.input_key, label_key=s.label_key, metadata_key=s.metadata_key, tokenizer=tokenizer,
            apply_chat_template=apply_chat_template, apply_chat_template_kwargs=apply_chat_template_kwargs,
            shuffle=False, n_samples_per_prompt=s.n_samples_per_eval_prompt)
            for s in sets} if self.function is None else {}
        self.start = {name: source.state_dict() for name, source in self.sources.items()}

    def run(self, rollout_id: int, data_buffer: DataBuffer | None) -> dict[str, float]:
        """Evaluate the engines' current weights; returns the metrics to report."""
        if self.function is not None:
            result = self.function(self.plugin_args, rollout_id, data_buffer, evaluation=True)
            data = getattr(result, "data", result)  # slime's RolloutFnEvalOutput, or its dict
        else:
            data = {s.name: self._run_set(s, rollout_id) for s in self.sets}
        if self.rollout.save_debug_rollout_data:
            samples = [s for result in data.values() for s in result.get("samples", [])]
            debug_data.save(self.rollout.save_debug_rollout_data, rollout_id, samples, evaluation=True)
        metrics = eval_metrics(data, self.plugin_args.n_samples_per_eval_prompt)
        if self.log_function is not None:
            if self.log_function(rollout_id, self.plugin_args, data, metrics):
                return {}  # slime's contract: True means the plug-in did the logging
        return metrics

    def _run_set(self, s: EvalSet, rollout_id: int) -> dict[str, Any]:
        source = self.sources[s.name]
        source.load_state_dict(self.start[s.name])  # every eval reads the set from its first prompt
        args = dataclasses.replace(
            self.rollout, rollout_batch_size=len(source.rows), n_samples_per_prompt=s.n_samples_per_eval_prompt,
            rollout_max_response_len=s.max_response_len, rollout_temperature=s.temperature, rollout_top_p=s.top_p,
            rollout_top_k=s.top_k, rollout_function_path=None, load_debug_rollout_data=None,
            save_debug_rollout_data=None, partial_rollout=False, dynamic_sampling_filter_path=None,
            over_sampling_batch_size=None)
        groups = generate_rollout(args, rollout_id, DataBuffer(source), evaluation=True)
        samples: list[Sample] = sorted((x for g in groups for x in g), key=lambda x: x.index)
        key = getattr(self.plugin_args, "eval_reward_key", None)  # slime's: defaults to --reward-key
        return {"rewards": [x.reward_value(key) for x in samples],
                "truncated": [x.status is Status.TRUNCATED for x in samples], "samples": samples}
