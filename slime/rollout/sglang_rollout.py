"""slime.rollout.sglang_rollout's GenerateState and generate, as slime's custom generate functions
use them (search-r1 and retool tokenize with GenerateState(args).tokenizer).

GenerateState is one object per trainer process, built from the first args it is given (slime's
SingletonMeta): the tokenizer of --hf-checkpoint, the processor (None: slurmrl trains text-only
models), slime's base sampling parameters, and a semaphore bounding requests in flight
(--rollout-concurrency, slurmrl's total over every engine: slime's --sglang-server-concurrency x
engines). `slime.rollout.sglang_rollout.generate_rollout` as --rollout-function-path is slurmrl's
built-in rollout (trainer.config.build)."""

from __future__ import annotations

import asyncio
from functools import lru_cache
from typing import Any

from rollout.sample import Sample, Status
from slime.utils.http_utils import post
from slime.utils.misc import SingletonMeta

__all__ = ["GenerateState", "generate", "get_model_url"]


@lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=True)


class GenerateState(metaclass=SingletonMeta):
    def __init__(self, args: Any) -> None:
        self.args = args
        self.tokenizer = _tokenizer(args.hf_checkpoint)
        self.processor = None  # slurmrl's models are text-only
        self.sampling_params: dict[str, Any] = dict(
            temperature=args.rollout_temperature, top_p=args.rollout_top_p, top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len, stop=args.rollout_stop,
            stop_token_ids=args.rollout_stop_token_ids, skip_special_tokens=args.rollout_skip_special_tokens,
            no_stop_trim=True, spaces_between_special_tokens=False)
        self._semaphores: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}
        self.reset()

    @property
    def semaphore(self) -> asyncio.Semaphore:
        """The bound on requests in flight, one per event loop (slurmrl runs each rollout in its own)."""
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores = {loop: asyncio.Semaphore(getattr(self.args, "rollout_concurrency", 64))}
        return self._semaphores[loop]

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set[asyncio.Task[Any]] = set()
        self.aborted = False


def get_model_url(args: Any, model_name: str, endpoint: str = "/generate") -> str:
    """The router's URL (slurmrl serves one model group per job: every name gets the router)."""
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """slime's built-in generate: the prompt's tokens (or the sample's own) to the router, the
    response appended with its log-probs, its status from the finish reason."""
    state = GenerateState(args)
    if sample.status not in (Status.PENDING, Status.ABORTED):
        raise ValueError(f"sample {sample.index} has status {sample.status.value}; generate continues only pending "
                         "or aborted samples")
    prompt_ids = sample.tokens or state.tokenizer.encode(sample.prompt, add_special_tokens=False)
    params = dict(sampling_params)
    params["max_new_tokens"] -= sample.response_length
    if params["max_new_tokens"] < 0:
        raise ValueError(f"max_new_tokens {params['max_new_tokens']}: the sample's response is already longer than "
                         "the sampling parameters allow")
    if params["max_new_tokens"] == 0:
        sample.status = Status.TRUNCATED
        return sample
    output = await post(get_model_url(args, "default"),
                        {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True})
    if not sample.tokens:
        sample.tokens = list(prompt_ids)
    pairs = output["meta_info"].get("output_token_logprobs", [])
    sample.append_response_tokens(args, tokens=[item[1] for item in pairs], log_probs=[item[0] for item in pairs],
                                  trainable=True, meta_info=output["meta_info"], text=output["text"])
    return sample
