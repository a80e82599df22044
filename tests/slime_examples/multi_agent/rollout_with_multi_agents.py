# Copied unchanged but for the agent system's module path (MULTI_AGENT_CONFIGS) from THUDM/slime (https://github.com/THUDM/slime) at 624b824a898ab0ec1fcb4d373004c7f3852bf515,
# examples/multi_agent/rollout_with_multi_agents.py. Copyright the slime authors, under the Apache License, Version 2.0
# (http://www.apache.org/licenses/LICENSE-2.0), slime's LICENSE. Run by tests/rollout/test_slime_examples.py.
import random

from transformers import AutoTokenizer

from slime.utils.misc import load_function
from slime.utils.types import Sample

MULTI_AGENT_CONFIGS = {
    "custom_multi_agent_function_path": "tests.slime_examples.multi_agent.agent_system.run_agent_system",
    "num_parallel": 5,
    "incorrect_reward_weight": 0.8,
    "correct_reward_weight": 1.2,
}


async def generate_with_multi_agents(args, sample: Sample, sampling_params, evaluation=False) -> list[Sample]:

    tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
    max_context_length = args.rollout_max_context_len if not evaluation else args.eval_max_context_len

    args.sampling_params = sampling_params
    args.rollout_max_context_len = max_context_length
    args.tokenizer = tokenizer

    for key, value in MULTI_AGENT_CONFIGS.items():
        setattr(args, key, value)

    custom_multi_agent_func = load_function(args.custom_multi_agent_function_path)
    samples = await custom_multi_agent_func(args, sample)

    random.shuffle(samples)

    return samples
