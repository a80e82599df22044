"""RolloutArgs: the rollout's share of the job's flags (slime's names), and the handlers and counts
kept across rounds, as the rollout (rollout.generate, rollout.group_generate) reads them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from rollout.engine_check import CHECK_TIMEOUT_S
from rollout.request_deadline import DecodeSpeed
from rollout.request_transport import RequestCounts
from rollout.sample_errors import SampleErrors


@dataclass
class RolloutArgs:
    """The rollout's share of the job's flags (slime's names)."""

    hf_checkpoint: str  # where the tokenizer comes from
    router_url: str  # http://{--sglang-router-ip}:{--sglang-router-port}
    api_key: str | None = None  # the job's key, for the router and the engines
    rollout_batch_size: int = 32  # groups (prompts) per rollout
    n_samples_per_prompt: int = 4
    rollout_max_response_len: int = 64
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    rollout_top_k: int = -1
    rollout_stop: list[str] | None = None
    rollout_stop_token_ids: list[int] | None = None
    rollout_skip_special_tokens: bool = False  # slime's default: the response text keeps them
    rollout_seed: int = 42
    rollout_concurrency: int = 64  # requests in flight at once
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # for prompts given as messages
    rm_type: str | None = None  # built-in reward: rewards.REWARD_TYPES, each with an optional boxed_ prefix
    custom_rm_path: str | None = None  # async f(args, sample) -> reward; with group_rm, f(args, samples) -> list
    group_rm: bool = False  # score a group at once, when all its samples are done
    reward_key: str | None = None  # the entry of a dict reward that is trained on
    rm_url: str | None = None  # remote_rm's reward server
    rm_concurrency: int = 64  # reward requests in flight at once
    rm_timeout: float = 120.0  # seconds for one reward request
    rm_max_retries: int = 10  # attempts per sample before the rollout fails
    rm_retry_backoff: float = 1.0  # seconds before the first retry; doubles, capped at 30 s
    custom_generate_function_path: str | None = None
    rollout_function_path: str | None = None
    over_sampling_batch_size: int | None = None  # groups started per batch with dynamic sampling
    dynamic_sampling_filter_path: str | None = None
    partial_rollout: bool = False
    mask_offpolicy_in_partial_rollout: bool = False  # a continued sample trains only on its new tokens
    rollout_sample_hook_path: list[str] = field(default_factory=list)  # hook(args, sample, *, rollout_id, evaluation)
    save_debug_rollout_data: str | None = None  # path with {rollout_id}
    load_debug_rollout_data: str | None = None
    retry_timeout_s: float = 1800.0  # give up on a request after this long without any engine
    router_timeout_s: float = 10.0  # one call to the router's worker API (the job's router_request_timeout)
    # Called with an engine url the router could not reach; default: remove it from the router.
    engine_failure_handler: Callable[[str], None] | None = field(default=None, repr=False)
    # Called with (engine url, why) for an engine that holds requests past their deadline or answers
    # what does not parse, while it may pass its probes; default: remove it from the router.
    engine_unresponsive_handler: Callable[[str, str], None] | None = field(default=None, repr=False)
    decode_speed: DecodeSpeed = field(default_factory=DecodeSpeed, repr=False)  # kept across rounds
    request_counts: RequestCounts = field(default_factory=RequestCounts, repr=False)  # requests retried, all rounds
    # Users' functions failing on single samples: --sample-error-policy, the count, the first reported.
    sample_errors: SampleErrors = field(default_factory=SampleErrors, repr=False)
    engine_check_timeout_s: float = CHECK_TIMEOUT_S  # one engine's 1-token check (engine_check.py)
    # What plug-ins get as `args`: the trainer's whole parsed flags, by slime's names (its
    # sglang_router_ip/port, hf_checkpoint...); None: this object.
    plugin_args: Any = field(default=None, repr=False)

    @property
    def for_plugins(self) -> Any:
        return self if self.plugin_args is None else self.plugin_args

    @property
    def sglang_router_ip(self) -> str:
        return urlsplit(self.router_url).hostname or ""

    @property
    def sglang_router_port(self) -> int | None:
        return urlsplit(self.router_url).port
