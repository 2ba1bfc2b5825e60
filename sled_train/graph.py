"""Draft graphs written out to ONNX: decoder blocks with explicit keys and values, an autoregressive draft (the
device's `onnx` drafter) and a parallel one (its `parallel` drafter: K slots from one forward).

Both take input_ids [1, n], past_keys / past_values [blocks, 1, kv_heads, P, head_dim] and return the present keys
and values [blocks, 1, kv_heads, P + n, head_dim], so rolling the cache back is slicing P. The autoregressive draft
returns logits [1, n, vocab]; the parallel one slot_logits [1, S, vocab (+1 for CTC's blank)].
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "mistral", "qwen2")  # decoder layers this block reproduces (RMSNorm, RoPE, GQA, SwiGLU)


def check_family(config) -> None:
    kind = getattr(config, "model_type", "?")
    if kind not in SUPPORTED:
        raise ValueError(f"drafts are built from {', '.join(SUPPORTED)} models; this one is {kind!r}")


def inv_freq(model) -> torch.Tensor:
    """RoPE's inverse frequencies as the model computes them (its rotary embedding's buffer, scaling applied)."""
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is not None and hasattr(rotary, "inv_freq"):
        return rotary.inv_freq.detach().float().clone()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope(positions: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, n, d] for positions [B, n]."""
    angles = positions.float()[..., None] * freqs
    emb = torch.cat((angles, angles), dim=-1)[:, None]
    return emb.cos(), emb.sin()


def causal_mask(past: int | torch.Tensor, n: int | torch.Tensor) -> torch.Tensor:
    """Additive mask [n, past + n]: row i sees keys up to past + i."""
    keys = torch.arange(past + n)[None, :]
    rows = (torch.arange(n) + past)[:, None]
    return torch.where(keys <= rows, 0.0, float("-inf"))


def _rotate(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Block(torch.nn.Module):
    """One decoder layer of a transformers Llama-family model: the layer's own modules (or copies, to train)."""

    def __init__(self, layer: torch.nn.Module, config, trainable: bool = False):
        super().__init__()
        take = copy.deepcopy if trainable else (lambda m: m)
        a, m = layer.self_attn, layer.mlp
        self.q, self.k, self.v, self.o = take(a.q_proj), take(a.k_proj), take(a.v_proj), take(a.o_proj)
        self.gate, self.up, self.down = take(m.gate_proj), take(m.up_proj), take(m.down_proj)
        self.ln1, self.ln2 = take(layer.input_layernorm), take(layer.post_attention_layernorm)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps

    def forward(self, h, cos, sin, mask, past_k=None, past_v=None):
        """h [B, n, hidden]; cos, sin [B, 1, n, d]; mask additive [n, P + n] or [B, 1, n, P + n]; past [B, kv, P, d].
        Returns the new h and the keys and values [B, kv, P + n, d]."""
        b, n, _ = h.shape
        x = rms(h, self.ln1.weight, self.eps)
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate(q) * sin
        k = k * cos + _rotate(k) * sin
        if past_k is not None:
            k = torch.cat([past_k, k], dim=2)
            v = torch.cat([past_v, v], dim=2)
        total, g = k.shape[2], self.heads // self.kv_heads
        kr = k[:, :, None].expand(b, self.kv_heads, g, total, self.head_dim).reshape(b, self.heads, total, self.head_dim)
        vr = v[:, :, None].expand(b, self.kv_heads, g, total, self.head_dim).reshape(b, self.heads, total, self.head_dim)
        att = (q @ kr.transpose(-1, -2)) * (self.head_dim ** -0.5) + mask
        o = (att.softmax(-1) @ vr).transpose(1, 2).reshape(b, n, -1)
        h = h + self.o(o)
        x = rms(h, self.ln2.weight, self.eps)
        return h + self.down(F.silu(self.gate(x)) * self.up(x)), k, v


def blocks_of(model, count: int) -> list[Block]:
    """The model's first `count` layers as blocks (sharing its weights)."""
    return [Block(layer, model.config) for layer in list(model.model.layers)[:count]]


class DraftGraph(torch.nn.Module):
    """Embedding, blocks, final norm, LM head: an autoregressive draft (the first layers of a model, and any heads
    trained on them)."""

    def __init__(self, model: torch.nn.Module, blocks: list[Block]):
        super().__init__()
        check_family(model.config)
        cfg = model.config
        self.blocks = torch.nn.ModuleList(blocks)
        self.norm_w = model.model.norm.weight
        self.eps = cfg.rms_norm_eps
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tied:  # one [hidden, vocab] initializer serves the embedding (gather) and the head (matmul)
            self.head_t = torch.nn.Parameter(model.model.embed_tokens.weight.detach().T.contiguous(),
                                             requires_grad=False)
        else:
            self.embed = model.model.embed_tokens
            self.lm_head = model.lm_head
        self.register_buffer("freqs", inv_freq(model), persistent=False)
        self.kv_heads = blocks[0].kv_heads
        self.head_dim = blocks[0].head_dim

    def embed_ids(self, input_ids):
        if self.tied:
            return self.head_t.index_select(1, input_ids[0]).transpose(0, 1)[None]
        return self.embed(input_ids)

    def head(self, h):
        x = rms(h, self.norm_w, self.eps)
        return x @ self.head_t if self.tied else self.lm_head(x)

    def context(self, input_ids, past_keys, past_values, blocks):
        """Runs the new tokens through `blocks` with the cache: h [1, n, hidden], keys, values."""
        n, past = input_ids.shape[1], past_keys.shape[3]
        cos, sin = rope((torch.arange(n) + past)[None], self.freqs)
        mask = causal_mask(past, n)
        h, keys, values = self.embed_ids(input_ids), [], []
        for i, block in enumerate(blocks):
            h, k, v = block(h, cos, sin, mask, past_keys[i], past_values[i])
            keys.append(k)
            values.append(v)
        return h, keys, values

    def forward(self, input_ids, past_keys, past_values):
        h, keys, values = self.context(input_ids, past_keys, past_values, self.blocks)
        return self.head(h), torch.stack(keys), torch.stack(values)


def slot_rows(rows: torch.Tensor, maps: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """rows [..., hidden] -> [..., S - 1, hidden]: each slot row is the row plus its own map of it (a residual
    SiLU layer on the normed row), so each slot can learn what its position asks of the context."""
    x = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)
    s, d, e = maps.shape  # one MatMul for all slots: ONNX Runtime's Einsum is slow on the CPU and int8 leaves it fp32
    moved = (x @ maps.permute(1, 0, 2).reshape(d, s * e)).unflatten(-1, (s, e))
    return rows[..., None, :] + F.silu(moved + bias)


class ParallelGraph(DraftGraph):
    """A backbone (causal over the context) and head blocks, in which slot 0 is the last context row and S - 1 slot
    rows, each that row's hidden state moved by its own learned map (slot_rows), attend to the whole context and
    bidirectionally to each other (SpecFormer's draft block). One forward gives every slot's distribution; a CTC
    head adds a blank logit."""

    def __init__(self, model, backbone: list[Block], head: list[Block], slot_maps: torch.nn.Parameter,
                 slots: torch.nn.Parameter, blank: torch.nn.Linear | None):
        super().__init__(model, backbone + head)
        self.backbone_len = len(backbone)
        self.slot_maps, self.slots = slot_maps, slots  # [S - 1, hidden, hidden], [S - 1, hidden]
        self.blank = blank

    def forward(self, input_ids, past_keys, past_values):
        n, past = input_ids.shape[1], past_keys.shape[3]
        s = self.slots.shape[0]
        h, keys, values = self.context(input_ids, past_keys, past_values, self.blocks[:self.backbone_len])
        x = torch.cat([h, slot_rows(h[:, -1], self.slot_maps, self.slots, self.eps)], dim=1)
        positions = torch.cat([torch.arange(n), torch.arange(s) + n]) + past  # slot j at the last position + j
        cos, sin = rope(positions[None], self.freqs)
        # context rows are causal and never see the slots; slot rows see everything
        top = torch.cat([causal_mask(past, n), torch.full((n, s), float("-inf"))], dim=1)
        mask = torch.cat([top, torch.zeros(s, past + n + s)], dim=0)
        for j, block in enumerate(self.blocks[self.backbone_len:]):
            i = self.backbone_len + j
            x, k, v = block(x, cos, sin, mask, past_keys[i], past_values[i])
            keys.append(k[:, :, :past + n])
            values.append(v[:, :, :past + n])
        rows = x[:, n - 1:]  # the last context row (slot 0), then the slot rows
        logits = self.head(rows)
        if self.blank is not None:
            logits = torch.cat([logits, self.blank(rms(rows, self.norm_w, self.eps))], dim=-1)
        return logits, torch.stack(keys), torch.stack(values)


def write_onnx(graph: torch.nn.Module, path, output_names: tuple[str, str, str], int8: bool, log=print) -> None:
    """Traces `graph` to `path` with a dynamic token count and cache length; `int8` quantizes MatMul weights."""
    import warnings
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fp32 = path.with_name(path.stem + ".fp32.onnx") if int8 else path
    blocks = len(graph.blocks)
    shape = (blocks, 1, graph.kv_heads, 3, graph.head_dim)
    args = (torch.tensor([[1, 2]]), torch.zeros(shape), torch.zeros(shape))
    first, keys, values = output_names
    axes = {"input_ids": {1: "new"}, "past_keys": {3: "past"}, "past_values": {3: "past"},
            keys: {3: "total"}, values: {3: "total"}}
    if first == "logits":
        axes[first] = {1: "new"}
    log(f"[export] tracing {blocks} blocks to {fp32} ...")
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(graph, args, str(fp32), dynamo=False, opset_version=17,
                          input_names=["input_ids", "past_keys", "past_values"], output_names=list(output_names),
                          dynamic_axes=axes)
    if int8:
        import logging

        import onnx
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)  # per node
        # Weight-only int8 (blockwise, MatMulNBits): activations stay float, so the outliers of small
        # LMs do not wreck it as dynamic activation quantization does.
        log("[export] quantizing MatMul weights to int8 (weight-only, block 32) ...")
        quant = MatMulNBitsQuantizer(onnx.load(str(fp32)), bits=8, block_size=32, is_symmetric=True,
                                     accuracy_level=4)
        quant.process()
        quant.model.save_model_to_file(str(path), use_external_data_format=False)
        fp32.unlink()
