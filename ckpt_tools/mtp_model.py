"""megatron-core's GPTModel with multi-token prediction (MTP) layers that run only when asked.

Upstream (0.16.1), a model built with MTP layers needs labels on every forward and then returns
the loss instead of the logits; slime's megatron fork runs them only when a training step hands
them their labels. Here a forward runs the decoder and the output layer alone, and returns the
logits as a model without MTP layers does: that is what conversion checks, log-probs and
publishing need. Given `mtp_targets` (a training forward), the MTP layers run too and their loss
is attached to the hidden states by megatron's MTPLossAutoScaler: the backward of whatever loss
the caller builds on the logits also carries the MTP loss's gradient, scaled by
MTPLossAutoScaler's main_loss_backward_scale (the caller sets it for its micro-batches).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
from torch import Tensor

# One MTP layer's targets over a micro-batch's tokens [1, t]: the token it predicts at each position
# and that prediction's weight (0 where it is not trained on)
MTPTargets = list[tuple[Tensor, Tensor]]


class MTPGPTModel(GPTModel):
    def __init__(self, *args: Any, hf_vocab_size: int, **kwargs: Any) -> None:
        """hf_vocab_size: the real vocabulary; the MTP loss's softmax leaves out megatron's padding
        (its size depends on TP), as the model's log-probs do."""
        super().__init__(*args, **kwargs)
        self.hf_vocab_size = hf_vocab_size
        self._mtp_targets: MTPTargets | None = None
        # Each MTP layer's (loss summed over its weighted tokens, their weight) in the last forward
        # with targets, detached: the caller's metrics.
        self.mtp_losses: list[tuple[Tensor, Tensor]] = []

    def forward(self, *args: Any, mtp_targets: MTPTargets | None = None, **kwargs: Any) -> Tensor:
        """GPTModel's forward; with `mtp_targets` (one pair per MTP layer) the MTP loss joins it."""
        self._mtp_targets = mtp_targets
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._mtp_targets = None

    def _postprocess(self, hidden_states: Tensor, input_ids: Tensor, position_ids: Tensor, labels: Tensor | None,
                     rotary_pos_emb: Any, rotary_pos_cos: Any, rotary_pos_sin: Any, mtp_in_postprocess: Any = None,
                     **kwargs: Any) -> Tensor:
        if self._mtp_targets is not None and mtp_in_postprocess:
            hidden_states = self.mtp(
                input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
                attention_mask=kwargs.get("attention_mask"), inference_params=kwargs.get("inference_params"),
                rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                packed_seq_params=kwargs.get("packed_seq_params"),
                sequence_len_offset=kwargs.get("sequence_len_offset"), embedding=self.embedding,
                **(kwargs.get("extra_block_kwargs") or {}))
            hidden_states = self._with_mtp_loss(hidden_states, self._mtp_targets, kwargs.get("runtime_gather_output"))
        # The upstream tail computes the MTP loss whenever the config has MTP layers: hide them from it.
        kept, self.config.mtp_num_layers = self.config.mtp_num_layers, None
        try:
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                                        rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=False, **kwargs)
        finally:
            self.config.mtp_num_layers = kept

    def _with_mtp_loss(self, hidden_states: Tensor, targets: MTPTargets, runtime_gather_output: Any) -> Tensor:
        """The decoder's own hidden states (the first of the 1 + n the MTP block stacks), carrying the
        MTP layers' loss: each layer's weighted mean cross-entropy, times mtp_loss_scaling_factor / n."""
        layers = self.config.mtp_num_layers
        assert len(targets) == layers, f"{len(targets)} MTP targets for {layers} MTP layers"
        stacked = torch.chunk(hidden_states, 1 + layers, dim=0)
        # As slime's megatron fork: the MTP loss does not train the shared output layer.
        weight = (self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights
                  else self.output_layer.weight).detach()
        main, self.mtp_losses = stacked[0], []
        for hidden, (predicted, weights) in zip(stacked[1:], targets, strict=True):
            logits, _ = self.output_layer(hidden, weight=weight, runtime_gather_output=runtime_gather_output)
            width = logits.shape[-1]  # this TP rank's slice of the vocabulary, or all of it if gathered
            start = 0 if width == self.vocab_size else parallel_state.get_tensor_model_parallel_rank() * width
            padding = torch.arange(start, start + width, device=logits.device) >= self.hf_vocab_size
            logits = logits.masked_fill(padding, float("-inf"))
            total = (self.compute_language_model_loss(predicted, logits) * weights).sum()
            count = weights.sum()
            self.mtp_losses.append((total.detach(), count.detach()))
            main = MTPLossAutoScaler.apply(main, self.config.mtp_loss_scaling_factor / layers * total
                                           / count.clamp(min=1))
        return main
