"""A rollout's samples -> the trainer's TrainSamples, as slime's RolloutManager converts them: by
default each sample's reward (--reward-key's entry of a dict) and loss mask; slime's plug-ins may
take over the rewards (--custom-reward-post-process-path: (raw_rewards, rewards)) or the whole
conversion (--custom-convert-samples-to-train-data-path: a dict of per-sample lists). The rewards
such a plug-in gives are trained on as given (build_config turns the group normalization off), and
the raw ones are what the reward metrics report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rollout.plugin_contracts import ConvertSamplesToTrainData, RewardPostProcess
from rollout.plugins import PluginError, raised
from rollout.sample import Sample, numbered
from trainer.batch import TrainSample

POST_PROCESS, CONVERT = "--custom-reward-post-process-path", "--custom-convert-samples-to-train-data-path"


@dataclass(frozen=True)
class TrainData:
    reward_key: str | None  # --reward-key
    plugin_args: Any = None  # what the plug-ins get as args
    post_process: RewardPostProcess | None = None
    post_process_path: str = ""
    convert: ConvertSamplesToTrainData | None = None
    convert_path: str = ""

    def of(self, groups: list[list[Sample]]) -> list[list[TrainSample]]:
        samples = [s for group in groups for s in group]
        if self.convert is not None:
            train = self._converted(samples)
        elif self.post_process is not None:
            train = self._post_processed(samples)
        else:
            train = [TrainSample.from_sample(s, self.reward_key) for s in samples]
        out, at = [], 0
        for group in groups:
            out.append(train[at:at + len(group)])
            at += len(group)
        return out

    def _post_processed(self, samples: list[Sample]) -> list[TrainSample]:
        try:
            raw, rewards = self.post_process(self.plugin_args, samples)  # type: ignore[misc]
        except Exception as err:
            raise raised(POST_PROCESS, self.post_process_path, err, "on a rollout's samples") from err
        _check_lengths(POST_PROCESS, self.post_process_path, {"raw_rewards": raw, "rewards": rewards}, len(samples))
        train = []
        for sample, raw_reward, reward in zip(samples, raw, rewards):
            one = TrainSample.from_sample(sample, self.reward_key, check_reward=False)
            one.reward, one.raw_reward = float(reward), float(raw_reward)
            train.append(one)
        return train

    def _converted(self, samples: list[Sample]) -> list[TrainSample]:
        try:
            data = self.convert(self.plugin_args, samples)  # type: ignore[misc]
        except Exception as err:
            raise raised(CONVERT, self.convert_path, err, "on a rollout's samples") from err
        needed = ("tokens", "response_lengths", "rewards", "loss_masks")
        if not isinstance(data, dict) or any(key not in data for key in needed):
            raise PluginError(f"{CONVERT} {self.convert_path} must return a dict with {', '.join(needed)}; got "
                              f"{data!r:.200}", CONVERT, self.convert_path)
        _check_lengths(CONVERT, self.convert_path, {k: data[k] for k in needed}, len(samples))
        raw = data["raw_reward"] if "raw_reward" in data else data["rewards"]
        logps = data.get("rollout_log_probs") or [None] * len(samples)
        train = []
        for i, sample in enumerate(samples):
            r = int(data["response_lengths"][i])
            train.append(TrainSample(
                tokens=torch.as_tensor(data["tokens"][i], dtype=torch.int64).reshape(-1), response_length=r,
                loss_mask=torch.as_tensor(data["loss_masks"][i], dtype=torch.float32).reshape(-1),
                reward=float(data["rewards"][i]), raw_reward=float(raw[i]), group_index=numbered(sample.group_index),
                rollout_log_probs=(None if logps[i] is None
                                   else torch.as_tensor(logps[i], dtype=torch.float32).reshape(-1)),
                weight_version=sample.generating_version, sample_index=sample.index))
        return train


def _check_lengths(flag: str, path: str, lists: dict[str, Any], count: int) -> None:
    for name, values in lists.items():
        if not isinstance(values, (list, tuple)) or len(values) != count:
            raise PluginError(f"{flag} {path} must give one {name} entry per sample ({count}); got {values!r:.200}",
                              flag, path)
