"""The trainer's flags: slime's names and defaults, each with its effect (help) or its refusal.
The model and training flags are here, the rollout-side ones in trainer.args_rollout_flags;
trainer.config.build_config validates a parse (model-shape flags against the HF config)."""

from __future__ import annotations

import argparse

from ckpt_tools.architectures import (
    BUILT_FAMILIES,
)
from ckpt_tools.gated_delta_rule import GDN_BACKENDS
from trainer.args_actions import (
    ArgsError,
    Choice,
    HelpFormatter,
    Parser,
    RefusedFlag,
    moe_layer_freq,
    refused,
)
from trainer.args_async_flags import add_async_flags
from trainer.args_rollout_flags import add_rollout_flags
from trainer.refused_flags import REFUSED

__all__ = ["ATTENTION_BACKENDS", "ESTIMATORS", "KL_TYPES", "ArgsError", "Parser", "RefusedFlag", "build_parser",
           "refused"]

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
# Megatron's --attention-backend names (and slurmrl's sdpa): unfused/local run megatron's unfused
# attention, the others SDPA (trainer.numerics limits its kernels for flash and fused).
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local", "sdpa")
ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
_SUPPORTED = f"slurmrl builds {BUILT_FAMILIES} models"

MTP_LOSS_SCALE = 0.2  # --mtp-loss-scaling-factor, slime's default


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m trainer", description="slurmrl's RL trainer (one process per GPU or CPU worker)",
               allow_abbrev=False, formatter_class=HelpFormatter)
    add = p.add_argument
    # checkpoints and model
    add("--hf-checkpoint", required=True, help="HF model folder: config, tokenizer, initial weights")
    add("--load", help="resume from this torch_dist save folder (missing or empty: start from --ref-load)")
    add("--ref-load", help="torch_dist weights to start from and, with KL, the reference model")
    add("--save", help="torch_dist save folder (SAVE/iter_XXXXXXX)")
    add("--save-interval", type=int, default=0, help="save every N rollouts (0: only at the end)")
    add("--save-hf", help="with each save, also the weights as an HF checkpoint in this folder, formatted with "
        "{rollout_id} (slime's; e.g. /ckpt/hf/iter_{rollout_id})")
    add("--keep-checkpoints", type=int, default=None, help="keep the newest N checkpoints")
    add("--ckpt-step", type=int, help="resume from exactly this iteration of --load")
    add("--job-dir", help="folder for weights, metrics and the heartbeat (default: --save or the cwd)")
    add("--train-backend", choices=("megatron", "fsdp"), default="megatron")
    add("--seed", type=int, default=1234)
    add("--no-save-optim", action="store_true", help="checkpoints hold no optimizer state (smaller); a run resumed "
        "from one starts its optimizer afresh, as slime's --no-load-optim does")
    add("--distributed-backend", choices=("nccl", "gloo"), help="the trainer's process group: nccl with GPUs "
        "(slime's default), gloo on CPU workers; the other one is refused")
    add("--distributed-timeout-minutes", type=int, default=10, help="a collective that waits longer fails the "
        "trainer (torch.distributed's timeout)")
    add("--record-memory-history", action="store_true", help="record the CUDA allocator's history from the start; "
        "dump a snapshot after rollout --memory-snapshot-num-steps - 1 (and on an out-of-memory error) to "
        "--memory-snapshot-dir (open it at pytorch.org/memory_viz)")
    add("--memory-snapshot-dir", default=".", help="where --record-memory-history's snapshots go")
    add("--memory-snapshot-num-steps", type=int, help="dump the memory snapshot after this many rollouts")
    add("--memory-snapshot-path", default="snapshot.pickle", help="the snapshot's file name (each rank's is "
        "memory_snapshot_time<T>_rank<R>_<this>)")
    add("--num-rollout", type=int, help="number of rollouts (RL iterations) to run (or give --num-epoch)")
    add("--num-epoch", type=int, help="without --num-rollout: this many passes over --prompt-data, as slime's "
        "num_rollout = num_epoch x (prompts // --rollout-batch-size)")
    add("--custom-config-path", help="YAML of arguments for custom functions: each key is set on args after the "
        "flags (a trainer flag's name changes that flag; others reach the plug-ins)")
    # model shape (optional; checked against the HF config)
    for flag in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "vocab_size"):
        add("--" + flag.replace("_", "-"), type=int)
    for flag in ("rotary_base", "rotary_percent", "norm_epsilon", "rotary_scaling_factor"):
        add("--" + flag.replace("_", "-"), type=float, help="must equal config.json's")
    for flag in ("mscale", "mscale_all_dim"):
        add("--" + flag.replace("_", "-"), type=float, help="YaRN's (DeepSeek-V3, Kimi-K2): must equal config.json's "
            "rope_scaling where its factor is above 1 (without scaling it has no effect)")
    for flag in ("qk_layernorm", "untie_embeddings_and_output_weights", "swiglu", "add_qkv_bias",
                 "disable_bias_linear", "moe_router_pre_softmax", "use_rope_scaling", "rotary_interleaved",
                 "post_self_attn_layernorm", "post_mlp_layernorm", "apply_layernorm_1p", "attention_output_gate",
                 "use_gated_attention", "moe_shared_expert_gate"):
        add("--" + flag.replace("_", "-"), action="store_true", default=None, help="must agree with config.json")
    for flag in ("num_experts", "moe_ffn_hidden_size", "moe_router_topk"):
        add("--" + flag.replace("_", "-"), type=int, help="must equal config.json's (MoE)")
    add("--moe-router-score-function", choices=("softmax", "sigmoid"), help="must agree with config.json (MoE)")
    for flag in ("multi_latent_attention", "moe_router_enable_expert_bias"):
        add("--" + flag.replace("_", "-"), action="store_true", default=None,
            help="must agree with config.json (DeepSeek-V3)")
    for flag in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                 "moe_shared_expert_intermediate_size", "moe_router_num_groups", "moe_router_group_topk"):
        add("--" + flag.replace("_", "-"), type=int, help="must equal config.json's (DeepSeek-V3)")
    add("--moe-router-topk-scaling-factor", type=float, help="must equal config.json's routed_scaling_factor")
    add("--moe-router-load-balancing-type", choices=("none", "aux_loss", "seq_aux_loss"), default="none",
        help="accepted without effect: --moe-aux-loss-coeff is 0 (the only value slurmrl takes), so no balancing "
             "loss reaches the gradient; the router trains on the policy loss alone")
    add("--moe-router-bias-update-rate", type=float, default=1e-3,
        help="after each optimizer step, each expert's routing bias moves by this much towards balanced load "
             "(megatron's aux-loss-free balancing; slime's DeepSeek scripts give 0: the bias stays as loaded)")
    add("--moe-layer-freq", type=moe_layer_freq, help="which layers are MoE: every one (1), or a 0/1 list (Megatron's "
        "[0]*K+[1]*N): the first K dense, which must be config.json's first_k_dense_replace (DeepSeek-V3, Kimi-K2)")
    dispatchers = Choice(("allgather", "alltoall"), {"flex": "megatron's flex dispatcher runs on DeepEP or HybridEP "
                                                              "(CUDA kernels slurmrl does not ship); use alltoall"})
    add("--moe-token-dispatcher-type", type=dispatchers, metavar=dispatchers.metavar,
        help="how tokens reach their experts (default allgather; alltoall, slime's, needs CUDA)")
    add("--moe-router-dtype", choices=("fp32", "fp64"), help="compute the router's logits and softmax in this dtype")
    add("--spec", nargs=2, metavar=("MODULE", "FUNCTION"), help="slime's layer spec: accepted where slurmrl builds "
        "the same layers from config.json (slime_plugins.models.glm4 get_glm_spec: GLM-4; slime_plugins.models."
        "minimax_m2 get_minimax_m2_layer_spec: MiniMax-M2; slime_plugins.models.qwen3_next get_qwen3_next_spec: "
        "Qwen3-Next; slime_plugins.models.qwen3_5 get_qwen3_5_spec: Qwen3.5, dense or MoE, its multimodal "
        "checkpoints' language model), refused otherwise")
    add("--model-name", help="slime's converter name: must name config.json's model_type (slurmrl converts by it)")
    # multi-token prediction (DeepSeek-V3, GLM-4.5/4.7: config.json's num_nextn_predict_layers), slime's flags
    add("--mtp-num-layers", type=int, help="keep this many MTP layers in the model (checkpoints, publishing); "
        "trained only with --enable-mtp-training")
    add("--enable-mtp-training", action="store_true",
        help="train the MTP layers: their loss over the response tokens joins the policy loss")
    add("--mtp-loss-scaling-factor", type=float, default=MTP_LOSS_SCALE,
        help="the MTP loss's weight (split evenly over the MTP layers), with --enable-mtp-training")
    refused(p, "--moe-grouped-gemm", "accepted: experts run as megatron's SequentialMLP, one GEMM per expert (the "
            "same numbers; grouped GEMM needs TransformerEngine or the grouped_gemm package)",
            switch=True, allowed=True)
    refused(p, "--moe-permute-fusion", "accepted: tokens are permuted by megatron's unfused code (the same numbers; "
            "the fused kernels need TransformerEngine)", switch=True, allowed=True)
    add("--group-query-attention", action="store_true",
        help="as in Megatron: --num-query-groups applies (the KV heads come from config.json)")
    norms = Choice(("RMSNorm",), {"LayerNorm": f"{_SUPPORTED}, all with RMSNorm"})
    add("--normalization", type=norms, metavar=norms.metavar, default="RMSNorm",
        help="the supported models all use RMSNorm")
    positions = Choice(("rope",), {kind: f"{_SUPPORTED}, all with rope" for kind in
                                   ("learned_absolute", "mrope", "relative", "none")})
    add("--position-embedding-type", type=positions, metavar=positions.metavar, default="rope",
        help="the supported models all use rope")
    add("--use-rotary-position-embeddings", action="store_true", help="as --position-embedding-type rope")
    refused(p, "--no-position-embedding", "accepted: Megatron's switch against a learned absolute position table, "
            "which no model slurmrl builds has (their positions are rope's)", switch=True, allowed=True)
    add("--make-vocab-size-divisible-by", type=int, default=128)
    add("--padded-vocab-size", type=int, help="must equal config.json's vocab_size padded to a multiple of "
        "--make-vocab-size-divisible-by x --tensor-model-parallel-size (slurmrl's padding, as megatron's)")
    add("--seq-length", type=int, help="a placeholder, as in slime (Megatron-LM requires it): samples are packed "
                                       "to --max-tokens-per-gpu and never cut")
    add("--max-position-embeddings", type=int, help="must equal config.json's (rope needs no position table)")
    add("--bf16", action="store_true", help="bf16 parameters and compute, with fp32 gradients and fp32 master "
                                            "weights in the optimizer and the checkpoint (megatron's --bf16)")
    add("--torch-compile", action="store_true", help="torch.compile each transformer layer and, at TP 1, the "
                                                     "log-prob computation (GPU)")
    # parallelism
    add("--tensor-model-parallel-size", type=int, default=1)
    # megatron parallelism: sequence parallel, expert TP (megatron backend)
    add("--sequence-parallel", action="store_true",
        help="split norms, dropout and MoE routing over the TP ranks along the sequence (no effect at TP 1)")
    add("--expert-tensor-parallel-size", type=int, default=None,
        help="TP degree of MoE expert weights (default: --tensor-model-parallel-size)")
    add("--pipeline-model-parallel-size", type=int, default=1,
        help="split the layers over this many stages, evenly unless the two flags below say otherwise "
             "(megatron-core's 1F1B schedule over the packs)")
    add("--decoder-first-pipeline-num-layers", type=int, help="layers of the first pipeline stage")
    add("--decoder-last-pipeline-num-layers", type=int, help="layers of the last pipeline stage")
    add("--context-parallel-size", type=int, default=1,
        help="split every packed sample over this many ranks (megatron's zigzag chunks; attention gathers K/V); "
             "needs a fused --attention-backend; --max-tokens-per-gpu is per rank, as slime's")
    add("--expert-model-parallel-size", type=int, default=1)
    # megatron's DDP (trainer.grad_buckets)
    add("--overlap-grad-reduce", action="store_true",
        help="launch the data-parallel gradient reduce bucket by bucket during the last micro-batch's backward")
    add("--ddp-bucket-size", type=int, help="elements per gradient-reduce bucket (megatron's default: "
                                            "max(40M, 1M x the data-parallel size))")
    add("--recompute-granularity", choices=("full", "selective"))
    add("--recompute-method", choices=("uniform", "block"))
    add("--recompute-num-layers", type=int)
    add("--only-train-params-name-list", nargs="*", help="regexes (re.search) of the megatron parameter names that "
        "train; every other parameter is frozen (slime's)")
    add("--freeze-params-name-list", nargs="*", help="regexes of the megatron parameter names to freeze (slime's)")
    add("--custom-megatron-init-path")
    add("--custom-megatron-before-log-prob-hook-path")
    add("--custom-megatron-before-train-step-hook-path")
    # optimizer
    add("--lr", type=float, default=1e-6)
    add("--min-lr", type=float, default=0.0)
    add("--lr-warmup-iters", type=int, default=0)
    add("--lr-warmup-fraction", type=float, help="warm up over this fraction of --lr-decay-iters (Megatron's)")
    decays = Choice(("constant", "linear", "cosine"), {
        style: "megatron's inverse-square-root and WSD schedules are not implemented; use constant, linear or cosine"
        for style in ("inverse-square-root", "WSD")})
    add("--lr-decay-style", type=decays, metavar=decays.metavar, default="linear",
        help="Megatron's default, as in slime: linear to --min-lr over the run (slime's recipes give constant)")
    add("--lr-decay-iters", type=int, help="optimizer steps to decay over (default: all of the run's steps)")
    add("--weight-decay", type=float, default=0.01, help="Megatron's default, as in slime")
    add("--adam-beta1", type=float, default=0.9)
    add("--adam-beta2", type=float, default=0.999, help="Megatron's default, as in slime")
    add("--adam-eps", type=float, default=1e-8)
    add("--clip-grad", type=float, default=1.0)
    add("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_false",
        help="megatron's: a NaN or infinite gradient norm skips its optimizer step, as slime does, instead of "
             "stopping the trainer (the default)")
    # megatron optimizer: kind, distributed (ZeRO-1) sharding, CPU offload (trainer.megatron.optimizer)
    add("--optimizer", choices=("adam", "sgd"), default="adam",
        help="adam: AdamW (decoupled weight decay), as megatron's")
    add("--sgd-momentum", type=float, default=0.9)
    add("--use-distributed-optimizer", action="store_true", default=True,
        help="shard optimizer state over data-parallel ranks (always on, as slime sets it)")
    add("--optimizer-cpu-offload", action="store_true", help="keep optimizer state and fp32 weights on the host")
    add("--overlap-cpu-optimizer-d2h-h2d", action="store_true",
        help="with --optimizer-cpu-offload: asynchronous gradient and weight copies")
    # colocation (trainer.colocation); supervised, the job spec's rollout.offload_* set them
    add("--offload-train", action="store_true",
        help="move weights, grads and optimizer state to the host while the engines generate")
    add("--offload-rollout", action="store_true",
        help="have the engines release their memory (weights, KV cache) while the trainer trains")
    add("--use-precision-aware-optimizer", action="store_true",
        help="accepted: the optimizer updates fp32 weights with fp32 gradients and moments, what slurmrl always does")
    add("--global-batch-size", type=int, help="samples per optimizer step (default: the whole rollout)")
    add("--num-steps-per-rollout", type=int, help="optimizer steps per rollout: --global-batch-size = "
                                                  "rollout-batch-size x n-samples-per-prompt / N")
    # RL loss
    add("--advantage-estimator", choices=ESTIMATORS, default="grpo")
    add("--disable-grpo-std-normalization", action="store_true")
    add("--normalize-advantages", action="store_true")
    add("--gamma", type=float, default=1.0)
    add("--lambd", type=float, default=1.0)
    add("--kl-coef", type=float, default=0.0, help="KL to the reference model as reward shaping")
    add("--use-kl-loss", action="store_true")
    add("--kl-loss-coef", type=float, default=0.0)
    add("--eps-clip", type=float, default=0.2)
    add("--eps-clip-high", type=float)
    add("--eps-clip-c", type=float, help="dual-clip constant (> 1)")
    add("--value-clip", type=float, default=0.2)
    add("--critic-lr", type=float)
    add("--entropy-coef", type=float, default=0.0)
    add("--calculate-per-token-loss", action="store_true")
    add("--use-tis", action="store_true")
    add("--tis-clip", type=float, default=2.0)
    add("--tis-clip-low", type=float, default=0.0, help="lower clamp of the TIS weights")
    add("--true-on-policy-mode", action="store_true")
    add("--true-on-policy-tolerance", type=float, default=1e-5)
    # on-policy distillation (slime's: a KL-to-teacher penalty on the advantages, on top of any estimator)
    add("--use-opd", action="store_true", help="on-policy distillation; needs --opd-type megatron")
    add("--opd-type", choices=("megatron", "sglang"), help="megatron: the teacher (--opd-teacher-load) is loaded "
                                                            "into the trainer; sglang is refused")
    add("--opd-teacher-load", help="on-policy distillation: a torch_dist teacher loaded into the trainer")
    add("--opd-teacher-ckpt-step", type=int, help="load this iteration of --opd-teacher-load")
    add("--opd-kl-coef", type=float, default=1.0)
    add("--ref-ckpt-step", type=int, help="load this iteration of --ref-load")
    # batching, loss and numerics (slime's data, algo and Megatron numerics flags)
    add("--micro-batch-size", type=int, default=1, help="samples per micro-batch (without --use-dynamic-batch-size)")
    add("--use-dynamic-batch-size", action="store_true",
        help="first-fit pack each micro-batch with up to --max-tokens-per-gpu tokens")
    add("--max-tokens-per-gpu", type=int, help="token budget of one micro-batch (with --use-dynamic-batch-size)")
    add("--log-probs-max-tokens-per-gpu", type=int,
        help="token budget of the log-prob passes' micro-batches (default: --max-tokens-per-gpu)")
    add("--balance-data", action="store_true",
        help="hand micro-batches to data-parallel ranks by Karmarkar-Karp on their token counts")
    add("--log-probs-chunk-size", type=int, default=-1,
        help="compute log-probs and entropies this many response tokens at a time, so their fp32 copies of the "
             "logits ([tokens, vocab]) exist for one chunk, in training's backward pass too (recomputed there); "
             "-1: all of a micro-batch's at once")
    refused(p, "--balance-by-flops", "micro-batches are packed first-fit by tokens; FLOPs-balanced packing is not "
            "implemented (use --balance-data)", switch=True)
    add("--kl-loss-type", choices=KL_TYPES, default="k1")
    add("--use-unbiased-kl", action="store_true", help="weigh the KL loss by the importance ratio pi/pi_old")
    add("--use-rollout-logprobs", action="store_true",
        help="the PPO ratio's old log-probs are the engines' instead of the trainer's")
    add("--loss-type", choices=("policy_loss", "sft_loss", "custom_loss"), default="policy_loss",
        help="sft_loss: the masked mean negative log-likelihood of the responses; custom_loss: "
             "--custom-loss-function-path's")
    add("--custom-loss-function-path", help="module.function(args, batch, logits, sum_of_sample_mean) -> (loss, "
        "metrics), slime's, per micro-batch, with --loss-type custom_loss (logits: trainer.slime_loss.ResponseLogits)")
    add("--disable-rewards-normalization", dest="rewards_normalization", action="store_false",
        help="grpo/gspo/reinforce_plus_plus_baseline: use the raw rewards, no group mean (and std) normalization")
    add("--disable-compute-advantages-and-returns", dest="compute_advantages_and_returns", action="store_false",
        help="no log-prob passes and no advantages before training (SFT: --loss-type sft_loss needs neither)")
    add("--custom-advantage-function-path", help="module.function(args, rollout_data) setting rollout_data's "
        "'advantages' and 'returns' in place of --advantage-estimator's (slime's; trainer.rollout_batch)")
    add("--custom-tis-function-path", help="module.function(args=, pg_loss=, train_log_probs=, rollout_log_probs=, "
        "loss_masks=, ...) -> (pg_loss, loss_masks, metrics) in place of vanilla TIS (slime's)")
    add("--custom-pg-loss-reducer-function-path", help="module.function(total_lengths, response_lengths, loss_masks, "
        "calculate_per_token_loss) -> the reducer of the per-token policy loss (slime's)")
    add("--get-mismatch-metrics", action="store_true", help="log the TIS function's train/rollout mismatch metrics "
        "(without --use-tis the loss is not reweighted)")
    add("--rollout-data-postprocess-path", help="module.function(args, rollout_id, rollout_data) after the "
        "advantages, before training: it may change advantages, returns and loss_masks (slime's)")
    refused(p, "--use-rollout-entropy", "the trainer's entropy is always computed with the old log-probs; it "
            "needs no flag", switch=True, allowed=True)
    for flag in ("--use-routing-replay", "--use-rollout-routing-replay"):
        refused(p, flag, "MoE routing replay is not implemented", switch=True)
    refused(p, "--use-opsm", "off-policy sequence masking is not implemented", switch=True)
    refused(p, "--opsm-delta", "off-policy sequence masking is not implemented", type=float, allowed=1e-4)
    refused(p, "--ref-update-interval", "the reference model stays the initial policy", type=int)
    refused(p, "--num-critic-only-steps", "critic-only warmup steps are not implemented", type=int, allowed=0)
    for flag in ("--attention-dropout", "--hidden-dropout"):
        refused(p, flag, "dropout is not supported in RL training; use 0.0", type=float, allowed=0.0)
    refused(p, "--accumulate-allreduce-grads-in-fp32", "accepted: slurmrl always keeps fp32 gradients and "
            "reduces them in fp32", switch=True, allowed=True)
    refused(p, "--attention-softmax-in-fp32", "accepted: the softmax always runs in fp32 (fp32 on CPU; bf16 "
            "autocast computes softmax in fp32; SDPA kernels accumulate in fp32)", switch=True, allowed=True)
    gdn_backends = Choice(GDN_BACKENDS, {"flashqla": "FlashQLA's kernels are not shipped or tested with slurmrl; use "
                                                     "fla (its Triton kernels) or torch"})
    add("--qwen-gdn-backend", type=gdn_backends, metavar=gdn_backends.metavar, default="fla",
        help="the kernel of Qwen3-Next's and Qwen3.5's gated delta nets: fla (flash-linear-attention's Triton "
             "kernels, CUDA; the trainer stops at start where fla is not installed) or torch (slurmrl's, any device, "
             "slower)")
    add("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
        help="auto/sdpa: torch's scaled_dot_product_attention; flash: its flash kernel only (CUDA); fused: its "
             "cuDNN/memory-efficient kernels (CUDA); unfused/local: the unfused attention")
    add("--deterministic-mode", action="store_true",
        help="deterministic cuDNN and torch.use_deterministic_algorithms (errors on ops without one)")
    add_rollout_flags(p)
    add_async_flags(p)
    for r in REFUSED:
        refused(p, r.flag, r.reason, allowed=r.allowed, type=r.type, switch=r.switch, nargs=r.nargs)
    for action in p._actions:
        action.help = action.help or "as in slime"
    return p
