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
from typing import Any

from rollout import debug_data
from rollout.buffer import DataBuffer
from rollout.data import JsonlDataSource
from rollout.eval_sets import EvalConfigError, EvalSet
from rollout.generate import RolloutArgs, generate_rollout
from rollout.plugin_contracts import EvalLogFunction, RolloutFunction
from rollout.plugins import load_function
from rollout.rollout_output import RolloutFnEvalOutput, call_rollout_fn
from rollout.sample import Sample, Status, group_positions, numbered


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
                 eval_function_path: str | None = None,
                 log_function_path: str | None = None) -> None:
        self.rollout, self.sets, self.plugin_args = rollout, sets, plugin_args
        self.function: RolloutFunction | None = (
            load_function(eval_function_path, "--eval-function-path") if eval_function_path else None)
        self.log_function: EvalLogFunction | None = (
            load_function(log_function_path, "--custom-eval-rollout-log-function-path") if log_function_path else None)
        self.sources = {s.name: JsonlDataSource(
            s.path, input_key=s.input_key, label_key=s.label_key, metadata_key=s.metadata_key, tokenizer=tokenizer,
            apply_chat_template=s.apply_chat_template, apply_chat_template_kwargs=s.apply_chat_template_kwargs,
            tool_key=s.tool_key, shuffle=False, n_samples_per_prompt=s.n_samples_per_eval_prompt, stamp=s.stamp)
            for s in sets} if self.function is None else {}
        self.start = {name: source.state_dict() for name, source in self.sources.items()}

    def run(self, rollout_id: int, data_buffer: DataBuffer | None) -> dict[str, float]:
        """Evaluate the engines' current weights; returns the metrics to report."""
        reported: dict[str, Any] = {}  # an eval function's own metrics (slime's RolloutFnEvalOutput)
        if self.function is not None:
            result = call_rollout_fn(self.function, self.plugin_args, rollout_id, data_buffer, evaluation=True)
            if not isinstance(result, RolloutFnEvalOutput):
                raise EvalConfigError(f"the eval function returned {type(result).__name__} with evaluation=True: "
                                      "return {name: {'rewards', 'truncated', 'samples'}} or RolloutFnEvalOutput")
            data, reported = result.data, dict(result.metrics or {})
        else:
            data = {s.name: self._run_set(s, rollout_id) for s in self.sets}
        if self.rollout.save_debug_rollout_data:
            samples = [s for result in data.values() for s in result.get("samples", [])]
            debug_data.save(self.rollout.save_debug_rollout_data, rollout_id, samples, evaluation=True)
        metrics = {**reported, **eval_metrics(data, self.plugin_args.n_samples_per_eval_prompt)}
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
            rollout_top_k=s.top_k, rollout_stop=s.stop, rollout_stop_token_ids=s.stop_token_ids,
            rollout_function_path=None, load_debug_rollout_data=None,
            save_debug_rollout_data=None, partial_rollout=False, dynamic_sampling_filter_path=None,
            over_sampling_batch_size=None)
        groups = generate_rollout(args, rollout_id, DataBuffer(source), evaluation=True)
        samples: list[Sample] = sorted((x for g in groups for x in g), key=lambda x: numbered(x.index))
        key = getattr(self.plugin_args, "eval_reward_key", None)  # slime's: defaults to --reward-key
        return {"rewards": [x.reward_value(key) for x in samples],
                "truncated": [x.status is Status.TRUNCATED for x in samples], "samples": samples}
