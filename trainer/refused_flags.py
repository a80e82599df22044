"""slime's flags that slurmrl does not implement, each with why and what to use instead.

The trainer's parser registers each one with trainer.args_actions.refused(): given, it stops the
job at submission with its reason, unless its value is `allowed` (what slurmrl does anyway). The
flags slurmrl implements are in trainer/args_parser.py and trainer/args_rollout_flags.py;
docs/flags.md lists both (python -m jobs.submit_flags).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpt_tools.architectures import BUILT_FAMILIES


@dataclass(frozen=True)
class Refusal:
    flag: str
    reason: str
    allowed: Any = None  # the one accepted value (None: refused whenever given)
    type: Any = str
    switch: bool = False  # a store_true flag: refused whenever given
    nargs: str | None = None


_MODELS = f"slurmrl builds {BUILT_FAMILIES} models from --hf-checkpoint's config.json"
_RAY = "slurmrl runs as one SLURM job with no Ray"
_TE = "it needs TransformerEngine, which slurmrl's trainer does not use"


def _switch(flag: str, reason: str) -> Refusal:
    return Refusal(flag, reason, switch=True)


def _accepted(flag: str, what_slurmrl_does: str) -> Refusal:
    """A switch that asks for what slurmrl always does: accepted, with no effect of its own."""
    return Refusal(flag, f"accepted: {what_slurmrl_does}", switch=True, allowed=True)


REFUSED: tuple[Refusal, ...] = (
    # -- models slurmrl does not build
    Refusal("--custom-model-provider-path", f"{_MODELS}; a custom model provider is not supported"),
    # -- MoE features slurmrl does not build (DeepEP)
    _switch("--moe-enable-deepep", "DeepEP's dispatcher needs the deep_ep package and CUDA; slurmrl uses "
                                   "megatron's alltoall (GPU) or allgather (CPU) dispatcher"),
    Refusal("--moe-aux-loss-coeff", "load-balancing losses are not used in RL fine-tuning (the router trains on "
            "the policy loss alone)", allowed=0.0, type=float),
    Refusal("--moe-token-drop-policy", "experts are dropless (no capacity factor), so no token is dropped",
            allowed="probs"),
    # -- kernels and precisions of TransformerEngine
    Refusal("--transformer-impl", f"{_TE}; the local implementation is used", allowed="local"),
    Refusal("--fp8-format", f"FP8 training: {_TE}"),
    Refusal("--fp8-recipe", f"FP8 training: {_TE}"),
    _accepted("--no-rope-fusion", f"slurmrl's rope is megatron's unfused one already (the fused one: {_TE})"),
    _accepted("--no-masked-softmax-fusion", "attention runs through SDPA or megatron's unfused attention, with no "
                                            "megatron softmax fusion"),
    _accepted("--no-gradient-accumulation-fusion", "gradients accumulate in fp32 (main_grad under --bf16) with no "
                                                   "fused wgrad kernel (it needs TransformerEngine/apex)"),
    Refusal("--megatron-deepgemm-forward-layers", f"DeepGEMM FP8 forward: {_TE}", nargs="+"),
    Refusal("--megatron-deepgemm-forward-modules", f"DeepGEMM FP8 forward: {_TE}", nargs="+"),
    Refusal("--megatron-deepgemm-moe-forward-layers", f"DeepGEMM FP8 forward: {_TE}", nargs="+"),
    Refusal("--megatron-deepgemm-moe-forward-modules", f"DeepGEMM FP8 forward: {_TE}", nargs="+"),
    _accepted("--enable-experimental", "no megatron-core feature slurmrl uses is behind megatron's experimental "
                                       "switch"),
    _switch("--freeze-indexer", f"the DSA indexer (DeepSeek sparse attention) is not in the models slurmrl builds; "
                                f"{_MODELS}; freeze parameters by name with --freeze-params-name-list"),
    _switch("--async-save", "checkpoints are written synchronously, then made durable before the tracker moves "
                            "(a checkpoint is never half-written); asynchronous saving is not supported"),
    _switch("--allgather-cp", "slurmrl's context parallelism always all-gathers K/V over the CP group, with "
            "megatron's load-balanced zigzag split; slime's --allgather-cp (a contiguous split, for DeepSeek sparse "
            "attention, which slurmrl does not build) does not apply"),
    # -- weight sync: slurmrl publishes full versions over --update-weight-transport disk | nccl
    Refusal("--update-weight-mode", "weights are published in full each version", allowed="full"),
    Refusal("--update-weight-delta-encoding", "weights are published in full each version (no deltas)",
            allowed="xor"),
    Refusal("--update-weight-delta-checksum", "weights are published in full each version (no deltas)",
            allowed="xxh3-128"),
    Refusal("--update-weight-disk-dir", "disk publishing writes under JOB_DIR/weights, which every engine "
                                        "reads; give --job-dir (or --save) on the shared filesystem instead"),
    _switch("--update-weight-disk-keep-files", "use --keep-weight-versions N to keep the newest N published "
                                               "versions"),
    Refusal("--custom-update-weight-post-write-path", "a hook between writing and loading published weights is "
                                                      "not supported"),
    Refusal("--update-weight-local-checkpoint-dir", "engines read published versions from the shared job dir; "
                                                    "node-local copies are not supported"),
    _switch("--check-weight-update-equal", "the engines report the version they loaded (weight_version); a "
                                           "tensor-by-tensor comparison is not supported"),
    _switch("--release-train", "the trainer stays resident; with --colocate the engines share its GPUs"),
    # -- Ray and slime's process layout
    Refusal("--train-env-vars", f"{_RAY}: export the variables before `slurmrl submit` (steps inherit the "
                                "environment) or set them in the sbatch template"),
    Refusal("--rollout-data-transport", f"{_RAY}: samples go to the trainer ranks over torch.distributed",
            allowed="object-store"),
    Refusal("--rollout-external-engine-addrs", "the supervisor launches and health-checks every engine; "
                                               "external engines are not supported", nargs="+"),
    Refusal("--http-proxy", "engines and the router are reached directly, never through a proxy"),
    _switch("--use-distributed-post", f"{_RAY}: requests go through the router from the trainer's rank 0"),
    # -- slime's external rollout buffer service
    Refusal("--rollout-buffer-url", "slime's external rollout-buffer service is not supported; use "
                                    "--rollout-function-path for a custom rollout"),
    Refusal("--fetch-trajectory-retry-times", "slime's external rollout-buffer service is not supported",
            allowed=-1, type=int),
    Refusal("--min-batch-collection-ratio", "slime's external rollout-buffer service is not supported",
            allowed=1.0, type=float),
    Refusal("--rollout-task-type", "slime's external rollout-buffer service is not supported", allowed="math"),
    Refusal("--data-pad-size-multiplier", "slime's external rollout-buffer service is not supported",
            allowed=128, type=int),
    Refusal("--rollout-sample-filter-path", "use --dynamic-sampling-filter-path (per group) or a custom "
                                            "generate function that sets loss_mask"),
    Refusal("--rollout-all-samples-process-path", "use --dynamic-sampling-filter-path or "
                                                  "--rollout-function-path"),
    # -- training options slurmrl does not have
    _switch("--recompute-loss-function", "the loss is computed once per micro-batch; recomputing it in the "
                                         "backward pass is not supported (use --recompute-granularity)"),
    Refusal("--megatron-config-path", "per-role Megatron YAML is not supported; the critic takes the actor's "
                                      "flags and --critic-lr"),
    _switch("--reset-optimizer-states", "the optimizer's moments persist across rollouts, as in an exact resume"),
    _switch("--use-stateless-adam", "the optimizer is Adam with persistent moments"),
    # -- slime's extra W&B panels
    Refusal("--log-reward-category", "per-category reward statistics are not computed; log them from a custom "
                                     "reward function's metadata"),
    _switch("--log-multi-turn", "multi-turn statistics are not computed; a custom generate function can put "
                                "its own numbers in Sample.metadata"),
    _switch("--log-correct-samples", "sample texts are not logged to W&B; use --save-debug-rollout-data"),
    # -- debugging and profiling slime does through its own tools
    Refusal("--load-forge-rollout-data", "use --load-debug-rollout-data with --debug-train-only"),
    Refusal("--save-debug-train-data", "use --save-debug-rollout-data: the trainer's inputs follow from it "
                                       "exactly"),
    Refusal("--dump-details", "use --save-debug-rollout-data and metrics.jsonl"),
    Refusal("--profile-target", "profile the trainer with `slurmrl profile JOB --train --steps N` while the job "
                                "runs (the torch profiler over N optimizer steps of every rank, one Chrome trace per "
                                "rank in JOB_DIR/profiles/)", allowed=["train_overall"], nargs="+"),
    Refusal("--memory-recorder", "memray is not installed with slurmrl; --record-memory-history records with "
                                 "torch's CUDA allocator", allowed="torch"),
    _switch("--ci-test", "slime's CI checks are its own test suite's"),
    _switch("--ci-disable-kl-checker", "slime's CI checks are its own test suite's"),
    Refusal("--ci-train-rollout-logprob-abs-diff-threshold", "use --true-on-policy-mode with "
                                                             "--true-on-policy-tolerance", allowed=0.1, type=float),
    Refusal("--ci-save-grad-norm", "slime's CI checks are its own test suite's"),
    Refusal("--ci-load-grad-norm", "slime's CI checks are its own test suite's"),
)
