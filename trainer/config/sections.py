"""The trainer's configuration sections: frozen, grouped, each field named as slime's flag (its
argparse dest), so the plug-in boundary can hand slime's Namespace back (trainer.config.plugins).
Fields marked "derived" are computed by trainer.config.build from other flags (or the environment)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# slime's fully asynchronous rollout (--rollout-function-path): slurmrl's trainer.fully_async_source
FULLY_ASYNC_ROLLOUT = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"


@dataclass(frozen=True)
class RunOptions:
    """What the run is: where it writes, how long it runs, which parts run."""

    job_dir: str  # derived: absolute --job-dir, else --save, else the cwd
    num_rollout: int  # derived from --num-epoch when not given
    num_epoch: int | None
    custom_config_path: str | None  # its keys were set on the flags before the config was built
    distributed_backend: str | None  # None: nccl with GPUs, gloo on CPU
    distributed_timeout_minutes: int
    record_memory_history: bool  # CUDA only (trainer.memory_history)
    memory_snapshot_dir: str
    memory_snapshot_num_steps: int | None
    memory_snapshot_path: str
    supervised: bool
    master_port: int | None
    debug_train_only: bool
    debug_rollout_only: bool
    offload_train: bool  # colocation: the trainer's state leaves the GPU while engines generate
    offload_rollout: bool  # colocation: the engines release their memory while the trainer trains


@dataclass(frozen=True)
class ModelOptions:
    """The policy model and how it computes (shape flags are in ShapeFlags)."""

    hf_checkpoint: str
    model_files: str  # derived: where config.json and the tokenizer are read (contract.job_dir.model_files_dir)
    train_backend: str
    seed: int
    bf16: bool
    torch_compile: bool
    log_probs_chunk_size: int  # <= 0: log-probs over a micro-batch's rows at once (trainer.token_stats)
    attention_backend: Literal["local", "sdpa"]  # derived: the layer spec's implementation (local: unfused)
    attention_kernels: str  # the --attention-backend flag as given: which SDPA kernels may run
    qwen_gdn_backend: Literal["fla", "torch"]  # Qwen3-Next's (Qwen3.5's) gated delta nets' kernel (gated_delta_rule)
    deterministic_mode: bool
    make_vocab_size_divisible_by: int
    padded_vocab_size: int | None  # checked: what make_vocab_size_divisible_by x TP gives
    moe_token_dispatcher_type: str | None
    moe_router_dtype: str | None
    only_train_params_name_list: list[str] | None  # trainer.freezing
    freeze_params_name_list: list[str] | None
    moe_router_bias_update_rate: float  # DeepSeek-V3's expert bias: its step after each optimizer step
    mtp_num_layers: int | None  # multi-token prediction layers kept (trainer.megatron.mtp)
    enable_mtp_training: bool  # their loss joins the policy loss
    mtp_loss_scaling_factor: float
    moe_router_load_balancing_type: str  # no effect: the aux-loss coefficient is 0
    custom_megatron_init_path: str | None
    custom_megatron_before_log_prob_hook_path: str | None
    custom_megatron_before_train_step_hook_path: str | None
    # slime's model flags slurmrl accepts with no effect of their own (the HF config decides)
    group_query_attention: bool
    normalization: str
    position_embedding_type: str
    use_rotary_position_embeddings: bool
    seq_length: int | None
    spec: list[str] | None  # slime's --spec: only one whose layers config.json builds too (model_checks.check_spec)
    model_name: str | None  # slime's --model-name: only config.json's model_type (model_checks.check_spec)


@dataclass(frozen=True)
class ShapeFlags:
    """Model-shape flags as given (None: not given); each must equal --hf-checkpoint's config.json
    (trainer.args.check_model_flags)."""

    num_layers: int | None
    hidden_size: int | None
    ffn_hidden_size: int | None
    num_attention_heads: int | None
    num_query_groups: int | None
    kv_channels: int | None
    vocab_size: int | None
    rotary_base: float | None
    rotary_percent: float | None
    norm_epsilon: float | None
    max_position_embeddings: int | None
    qk_layernorm: bool | None
    untie_embeddings_and_output_weights: bool | None
    swiglu: bool | None
    add_qkv_bias: bool | None
    disable_bias_linear: bool | None
    num_experts: int | None
    moe_ffn_hidden_size: int | None
    moe_router_topk: int | None
    moe_router_score_function: str | None
    moe_router_pre_softmax: bool | None
    moe_layer_freq: int | list[int] | None  # 1, or a per-layer 0/1 list (first_k_dense_replace)
    use_rope_scaling: bool | None
    rotary_scaling_factor: float | None
    mscale: float | None  # YaRN's, with multi-latent attention
    mscale_all_dim: float | None
    # DeepSeek-V3: multi-latent attention, shared experts, expert-bias grouped routing
    multi_latent_attention: bool | None
    q_lora_rank: int | None
    kv_lora_rank: int | None
    qk_head_dim: int | None
    qk_pos_emb_head_dim: int | None
    v_head_dim: int | None
    moe_shared_expert_intermediate_size: int | None
    moe_router_enable_expert_bias: bool | None
    moe_router_num_groups: int | None
    moe_router_group_topk: int | None
    moe_router_topk_scaling_factor: float | None
    # the dense GLM-4s
    rotary_interleaved: bool | None
    post_self_attn_layernorm: bool | None
    post_mlp_layernorm: bool | None
    # Qwen3-Next, Qwen3.5
    apply_layernorm_1p: bool | None
    attention_output_gate: bool | None
    use_gated_attention: bool | None
    moe_shared_expert_gate: bool | None


@dataclass(frozen=True)
class ParallelOptions:
    """Megatron's model parallelism and activation recomputation."""

    tensor_model_parallel_size: int
    sequence_parallel: bool
    expert_tensor_parallel_size: int | None
    pipeline_model_parallel_size: int
    decoder_first_pipeline_num_layers: int | None
    decoder_last_pipeline_num_layers: int | None
    context_parallel_size: int
    expert_model_parallel_size: int
    overlap_grad_reduce: bool
    ddp_bucket_size: int | None
    recompute_granularity: str | None
    recompute_method: str | None
    recompute_num_layers: int | None


@dataclass(frozen=True)
class OptimizerOptions:
    """The optimizer and its learning-rate schedule."""

    lr: float
    min_lr: float
    lr_warmup_iters: int  # derived from --lr-warmup-fraction when that is given
    lr_warmup_fraction: float | None
    lr_decay_style: str
    lr_decay_iters: int  # derived: default, every optimizer step of the run
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    check_for_nan_in_loss_and_grad: bool  # megatron's: a NaN/inf gradient stops the job; off, the step is skipped
    optimizer: str
    sgd_momentum: float
    use_distributed_optimizer: bool
    optimizer_cpu_offload: bool
    overlap_cpu_optimizer_d2h_h2d: bool
    use_precision_aware_optimizer: bool
    critic_lr: float | None


@dataclass(frozen=True)
class BatchingOptions:
    """Optimizer steps per rollout and the micro-batches of each (trainer.batch.Batching)."""

    global_batch_size: int  # derived: default, the whole rollout (or it / --num-steps-per-rollout)
    num_steps_per_rollout: int | None
    micro_batch_size: int
    use_dynamic_batch_size: bool
    max_tokens_per_gpu: int | None
    log_probs_max_tokens_per_gpu: int | None
    balance_data: bool


@dataclass(frozen=True)
class LossOptions:
    """Advantages and the policy loss (trainer.rl_step, trainer.losses.LossConfig)."""

    advantage_estimator: str
    disable_grpo_std_normalization: bool
    normalize_advantages: bool
    rewards_normalization: bool
    gamma: float
    lambd: float
    kl_coef: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    use_unbiased_kl: bool
    eps_clip: float
    eps_clip_high: float | None
    eps_clip_c: float | None
    value_clip: float
    entropy_coef: float
    calculate_per_token_loss: bool
    use_tis: bool
    tis_clip: float
    tis_clip_low: float
    true_on_policy_mode: bool
    true_on_policy_tolerance: float
    use_rollout_logprobs: bool
    loss_type: str
    custom_loss_function_path: str | None  # with loss_type custom_loss (trainer.slime_loss)
    compute_advantages_and_returns: bool  # False (SFT): no log-prob passes, no advantages
    custom_advantage_function_path: str | None
    custom_tis_function_path: str | None
    custom_pg_loss_reducer_function_path: str | None
    get_mismatch_metrics: bool
    rollout_data_postprocess_path: str | None
    use_opd: bool  # on-policy distillation: validated to go with --opd-teacher-load
    opd_type: str | None
    opd_kl_coef: float
    ref_model_needed: bool  # derived: a KL loss or a KL penalty needs the reference model


@dataclass(frozen=True)
class RolloutOptions:
    """The prompts, the sampling and the rollout plug-ins (rollout.generate.RolloutArgs)."""

    prompt_data: str | None
    input_key: str
    label_key: str | None
    metadata_key: str
    tool_key: str
    apply_chat_template: bool
    apply_chat_template_kwargs: dict[str, Any]
    rollout_shuffle: bool
    rollout_global_dataset: bool
    rollout_seed: int
    rollout_batch_size: int
    n_samples_per_prompt: int
    rollout_max_response_len: int
    rollout_temperature: float
    rollout_top_p: float
    rollout_top_k: int
    rollout_stop: list[str] | None
    rollout_stop_token_ids: list[int] | None
    rollout_skip_special_tokens: bool
    rollout_max_prompt_len: int | None  # derived: default, --rollout-max-context-len - 1
    rollout_max_context_len: int | None
    rollout_concurrency: int
    retry_timeout_s: float
    rollout_function_path: str | None  # derived: None for slime's default (the built-in rollout)
    custom_generate_function_path: str | None
    over_sampling_batch_size: int | None
    dynamic_sampling_filter_path: str | None
    partial_rollout: bool
    mask_offpolicy_in_partial_rollout: bool
    rollout_sample_hook_path: list[str]
    buffer_filter_path: str | None
    save_debug_rollout_data: str | None
    load_debug_rollout_data: str | None
    loss_mask_type: str

    @property
    def fully_async(self) -> bool:
        """slime's fully asynchronous rollout, by its path: the loop's source, not a plug-in."""
        return self.rollout_function_path == FULLY_ASYNC_ROLLOUT

    @property
    def rollout_plugin(self) -> str | None:
        """The --rollout-function-path the built-in rollout calls (None: it generates itself)."""
        return None if self.fully_async else self.rollout_function_path


@dataclass(frozen=True)
class RewardOptions:
    """How samples are scored (rollout.rewards, rollout.remote_rm)."""

    rm_type: str | None
    custom_rm_path: str | None
    custom_reward_post_process_path: str | None  # rewards trained on as it gives them
    custom_convert_samples_to_train_data_path: str | None
    group_rm: bool
    reward_key: str | None
    eval_reward_key: str | None  # derived: default, --reward-key
    rm_url: str | None
    rm_concurrency: int
    rm_timeout: float
    rm_max_retries: int
    rm_retry_backoff: float
    sample_error_policy: str  # rollout.sample_errors.POLICIES


@dataclass(frozen=True)
class EvalOptions:
    """Named eval sets run on the live engines between rollouts (rollout.eval); when they run is
    trainer.evals.EvalSchedule's."""

    eval_interval: int | None
    eval_prompt_data: list[str] | None
    eval_config: str | None
    eval_datasets: list[Any]  # derived: rollout.eval.EvalSet of each NAME PATH pair
    skip_eval_before_train: bool
    eval_input_key: str | None
    eval_label_key: str | None
    n_samples_per_eval_prompt: int
    eval_temperature: float | None
    eval_top_p: float | None
    eval_top_k: int | None
    eval_max_response_len: int | None
    eval_max_context_len: int | None  # for plug-ins alone, as in slime (multi_agent's eval prompts)
    eval_function_path: str | None
    custom_eval_rollout_log_function_path: str | None


@dataclass(frozen=True)
class PublishOptions:
    """The engines and how weights reach them (trainer.publish)."""

    sglang_router_ip: str | None
    sglang_router_port: int | None
    engine_urls: list[str] | None
    api_key: str | None  # derived: the job's key from the environment, never a flag (ps would show it)
    update_weight_transport: Literal["disk", "nccl", "tensor"]
    update_weight_buffer_size: int
    keep_weight_versions: int
    update_weight_timeout: float

    @property
    def router_url(self) -> str | None:
        return f"http://{self.sglang_router_ip}:{self.sglang_router_port}" if self.sglang_router_ip else None


@dataclass(frozen=True)
class AsyncOptions:
    """Generation overlapping training (trainer.ahead_source; slime's train_async.py)."""

    train_async: bool  # slime's train_async.py: rollout N+1 is generated while rollout N trains
    update_weights_interval: int  # publish after every N-th rollout (train_async only, as in slime)
    keep_old_actor: bool  # old log-probs by the weights that generated each sample (trainer.old_actor)
    # miles' flags of the fully asynchronous rollout (trainer.fully_async_source)
    max_weight_staleness: int | None
    async_data_buffer_capacity_factor: float
    async_unused_samples_handler: str
    pause_generation_mode: str


@dataclass(frozen=True)
class CheckpointOptions:
    """Where weights start, resume and are saved (trainer.checkpoint, ckpt_tools.tracker)."""

    load: str | None
    ckpt_step: int | None
    ref_load: str | None
    ref_ckpt_step: int | None
    opd_teacher_load: str | None
    opd_teacher_ckpt_step: int | None
    save: str | None
    save_interval: int
    keep_checkpoints: int | None
    no_save_optim: bool
    save_hf: str | None  # a folder name with {rollout_id}


@dataclass(frozen=True)
class LoggingOptions:
    """metrics.jsonl always; TensorBoard and W&B (trainer.metrics, trainer.wandb_log)."""

    tensorboard_dir: str | None  # derived: TENSORBOARD_DIR, or from --tb-project-name
    use_tensorboard: bool
    tb_project_name: str | None
    tb_experiment_name: str | None
    log_passrate: bool
    use_wandb: bool
    wandb_mode: str | None
    wandb_dir: str | None
    wandb_key: str | None
    wandb_host: str | None
    wandb_team: str | None
    wandb_project: str | None
    wandb_group: str | None
    wandb_random_suffix: bool
    wandb_always_use_train_step: bool
    wandb_run_id: str | None
