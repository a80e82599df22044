"""The rollout's share of the configuration as rollout.generate.RolloutArgs: the rollout and reward
sections, plus the engines' address and the handlers only the running trainer has."""

from __future__ import annotations

from collections.abc import Callable

from rollout.generate import RolloutArgs
from rollout.sample_errors import FirstErrorHandler, SampleErrors
from trainer.config.trainer_config import TrainerConfig


def rollout_args(config: TrainerConfig, router_url: str, router_timeout_s: float,
                 on_engine_failure: Callable[[str], None] | None,
                 on_engine_unresponsive: Callable[[str, str], None] | None = None,
                 on_sample_error: FirstErrorHandler | None = None) -> RolloutArgs:
    ro, rm = config.rollout, config.reward
    return RolloutArgs(
        sample_errors=SampleErrors(rm.sample_error_policy, on_first=on_sample_error),
        hf_checkpoint=config.model.model_files, router_url=router_url, router_timeout_s=router_timeout_s,
        api_key=config.publish.api_key, engine_failure_handler=on_engine_failure,
        engine_unresponsive_handler=on_engine_unresponsive, plugin_args=config.plugin_namespace(),
        rollout_batch_size=ro.rollout_batch_size, n_samples_per_prompt=ro.n_samples_per_prompt,
        rollout_max_response_len=ro.rollout_max_response_len, rollout_temperature=ro.rollout_temperature,
        rollout_top_p=ro.rollout_top_p, rollout_top_k=ro.rollout_top_k, rollout_stop=ro.rollout_stop,
        rollout_stop_token_ids=ro.rollout_stop_token_ids, rollout_skip_special_tokens=ro.rollout_skip_special_tokens,
        rollout_seed=ro.rollout_seed, rollout_concurrency=ro.rollout_concurrency,
        apply_chat_template_kwargs=ro.apply_chat_template_kwargs,
        custom_generate_function_path=ro.custom_generate_function_path,
        rollout_function_path=ro.rollout_plugin, over_sampling_batch_size=ro.over_sampling_batch_size,
        dynamic_sampling_filter_path=ro.dynamic_sampling_filter_path, partial_rollout=ro.partial_rollout,
        mask_offpolicy_in_partial_rollout=ro.mask_offpolicy_in_partial_rollout,
        rollout_sample_hook_path=ro.rollout_sample_hook_path, save_debug_rollout_data=ro.save_debug_rollout_data,
        load_debug_rollout_data=ro.load_debug_rollout_data, retry_timeout_s=ro.retry_timeout_s,
        rm_type=rm.rm_type, custom_rm_path=rm.custom_rm_path, group_rm=rm.group_rm, reward_key=rm.reward_key,
        rm_url=rm.rm_url, rm_concurrency=rm.rm_concurrency, rm_timeout=rm.rm_timeout,
        rm_max_retries=rm.rm_max_retries, rm_retry_backoff=rm.rm_retry_backoff)
