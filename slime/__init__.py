"""slime's plug-in API, at slime's import paths, so a plug-in written for slime imports unchanged:

    from slime.utils.types import Sample                      (append_response_tokens, optional index)
    from slime.utils.http_utils import post, get
    from slime.utils.misc import load_function, SingletonMeta
    from slime.rollout.sglang_rollout import GenerateState, generate
    from slime.rollout.base_types import RolloutFnTrainOutput, RolloutFnEvalOutput
    from slime.rollout.rm_hub import async_rm, batched_async_rm, grade_answer_verl
    from slime.rollout.rm_hub.math_dapo_utils import compute_score
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput
    --rollout-function-path slime.rollout.sft_rollout.generate_rollout

Only what plug-ins import lives here; it is slurmrl's own code under slime's names (install slime
itself beside slurmrl and one would shadow the other). The contracts the plug-ins fill are
rollout/plugin_contracts.py's Protocols.
"""
