"""megatron-core's local core attention for multi-latent attention (DeepSeek).

MLA builds its core attention with k_channels / v_channels (queries and keys are wider than values);
megatron-core 0.16.1's local DotProductAttention takes neither (only TransformerEngine's does), so
the local spec cannot build an MLA layer without TE. This one takes them and sizes its output by the
value width; the score computation is the parent's, unchanged.
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention


class MLADotProductAttention(DotProductAttention):
    """DotProductAttention for MLA: [s, b, np, k_channels] queries/keys, [s, b, np, v_channels] values."""

    def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels
