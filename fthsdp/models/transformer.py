"""A small decoder-only transformer LM in flax NNX (pre-norm, learned positions)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fthsdp.config import ModelConfig


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.norm1 = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=cfg.num_heads, in_features=cfg.d_model, decode=False,
            dtype=dtype, rngs=rngs,
        )
        self.norm2 = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        hidden = cfg.mlp_ratio * cfg.d_model
        self.up = nnx.Linear(cfg.d_model, hidden, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(hidden, cfg.d_model, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class DecoderLM(nnx.Module):
    """tokens (batch, seq) int32 -> logits (batch, seq, vocab) float32."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.max_seq_len, cfg.d_model)))
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        seq = tokens.shape[1]
        x = self.embed(tokens) + self.pos[...][:seq].astype(self.embed.embedding.dtype)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x)).astype(jnp.float32)
