"""One forward pass of the target over a ragged batch of sessions, against the KV pool.

The runner reads the weights of a transformers Llama-family model (no copy) and
does its own forward so that every session attends over its own cache slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention import ATTENTION, Segment, causal_masks

from .kv_cache import KVCache


@dataclass(frozen=True)
class ModelInput:
    token_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slots: torch.Tensor  # [num_tokens] int64, cache slot of each token
    segments: list[Segment]
    logit_rows: torch.Tensor  # [num_logit_rows] int64, flat indices whose logits are wanted


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCache, attention: str = "sdpa"):
        cfg = model.config
        if getattr(cfg, "model_type", None) not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"unsupported target architecture {cfg.model_type!r}: SLED runs Llama-family models")
        self.model = model
        self.kv = kv
        self.attention = ATTENTION[attention]
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.layers = list(inner.layers)
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.device = self.embed.device
        self.dtype = self.embed.dtype
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        if rope.get("rope_type", "default") not in ("default", None):
            raise ValueError(f"unsupported rope type {rope.get('rope_type')!r}")
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))
        freqs = torch.outer(torch.arange(kv.max_seq_len, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=self.device, dtype=self.dtype)  # [max_seq_len, head_dim]
        self.sin = emb.sin().to(device=self.device, dtype=self.dtype)

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[0]

    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> torch.Tensor:  # [num_logit_rows, vocab]
        tokens = inp.token_ids.to(self.device)
        positions = inp.positions.to(self.device)
        slots = inp.slots.to(self.device)
        n = tokens.shape[0]
        h = F.embedding(tokens, self.embed)  # [num_tokens, hidden]
        cos = self.cos[positions].unsqueeze(1)  # [num_tokens, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1)
        masks = causal_masks(inp.segments, self.device, self.num_heads // self.num_kv_heads)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = _rms_norm(h, layer.input_layernorm.weight, self.eps)
            q = attn.q_proj(x).view(n, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache, v_cache = self.kv.k[i], self.kv.v[i]
            k_cache[slots, :, positions] = k
            v_cache[slots, :, positions] = v
            o = self.attention(q, k_cache, v_cache, inp.segments, self.scale, masks)
            h = h + attn.o_proj(o.reshape(n, -1))
            x = _rms_norm(h, layer.post_attention_layernorm.weight, self.eps)
            mlp = layer.mlp
            h = h + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        rows = h[inp.logit_rows.to(self.device)]
        return F.linear(_rms_norm(rows, self.norm, self.eps), self.lm_head).float()
