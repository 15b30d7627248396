"""Qwen3.5's native multi-token-prediction (MTP) head.

Given the backbone's hidden state h_t at position t and the token x_{t+1} that follows it,
the head predicts x_{t+2}: `fc([norm(embed(x_{t+1})), norm(h_t)])`, one full-attention
decoder layer with its own KV cache, a final norm, then the backbone's lm_head. Its cache
holds one entry per (h_t, x_{t+1}) pair fed, at position t, so it only ever holds confirmed
tokens: a rejected draft never reaches it and it never needs a rollback at depth 1.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_5 import TextModelArgs

from cluster.model.layers import PackedDecoderLayer, Segment


class MTPHead(nn.Module):
    def __init__(self, args: TextModelArgs, num_layers: int = 1):
        super().__init__()
        hidden = args.hidden_size
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        # A layer index whose place in the interval pattern is full attention.
        attention_index = args.full_attention_interval - 1
        self.layers = [PackedDecoderLayer(args, attention_index) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)

    def __call__(self, embeddings: mx.array, hidden: mx.array, segments: list[Segment]) -> mx.array:
        """Packed pairs in, normed hidden states out (the caller applies lm_head)."""
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        for slot, layer in enumerate(self.layers):
            x = layer(x, segments, slot)
        return self.norm(x)
