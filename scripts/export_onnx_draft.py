"""Export a draft model to ONNX with KV-cache inputs and outputs, for the device's onnx drafter.

    python scripts/export_onnx_draft.py --output drafts/smollm2-l8.onnx --layers 8 --int8

The source is a GGUF file or a Hugging Face folder (default: the SmolLM2-135M-Instruct GGUF).
`--layers N` keeps only the first N transformer layers, then the final norm and the LM head: a
self-speculative draft of the same model. `--int8` quantizes the weights with ONNX Runtime's
weight-only quantization (MatMulNBits). A JSON file beside the model records its shapes and tokens.

Graph: input_ids [1, L] int64, past_keys / past_values [layers, 1, kv_heads, P, head_dim] float32
-> logits [1, L, vocab], present_keys / present_values [layers, 1, kv_heads, P + L, head_dim].
Rolling back the cache is slicing P.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F


from verify_server.model_loader import load_target


class DraftLM(torch.nn.Module):
    """The first `num_layers` layers of a Llama-family model with explicit, stacked past keys and values."""

    def __init__(self, model: torch.nn.Module, num_layers: int):
        super().__init__()
        cfg = model.config
        self.layers = torch.nn.ModuleList(list(model.model.layers)[:num_layers])
        self.embed = model.model.embed_tokens
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tied:
            self.head_t = torch.nn.Parameter(model.model.embed_tokens.weight.detach().T.contiguous())
            self.embed = None
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        inv = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def _norm(self, x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    @staticmethod
    def _rotate(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, input_ids, past_keys, past_values):
        n = input_ids.shape[1]
        past = past_keys.shape[3]
        pos = torch.arange(n, dtype=torch.float32) + past  # [L]
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]  # [1, 1, L, d]
        total = past + n
        key_pos = torch.arange(total)[None, :]
        query_pos = (torch.arange(n) + past)[:, None]
        mask = torch.where(key_pos <= query_pos, 0.0, float("-inf"))  # [L, P + L]
        g = self.heads // self.kv_heads
        if self.tied:  # one [hidden, vocab] initializer serves the embedding (gather) and the head (matmul)
            h = self.head_t.index_select(1, input_ids[0]).transpose(0, 1)[None]
        else:
            h = self.embed(input_ids)
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            x = self._norm(h, layer.input_layernorm.weight)
            q = a.q_proj(x).view(1, n, self.heads, self.head_dim).transpose(1, 2)
            k = a.k_proj(x).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
            v = a.v_proj(x).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + self._rotate(q) * sin
            k = k * cos + self._rotate(k) * sin
            k = torch.cat([past_keys[i], k], dim=2)  # [1, kv_heads, P + L, d]
            v = torch.cat([past_values[i], v], dim=2)
            keys.append(k)
            values.append(v)
            kr = k[:, :, None].expand(1, self.kv_heads, g, total, self.head_dim).reshape(1, self.heads, total, self.head_dim)
            vr = v[:, :, None].expand(1, self.kv_heads, g, total, self.head_dim).reshape(1, self.heads, total, self.head_dim)
            att = (q @ kr.transpose(-1, -2)) * (self.head_dim ** -0.5) + mask
            o = (att.softmax(-1) @ vr).transpose(1, 2).reshape(1, n, -1)
            h = h + a.o_proj(o)
            x = self._norm(h, layer.post_attention_layernorm.weight)
            m = layer.mlp
            h = h + m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))
        x = self._norm(h, self.norm.weight)
        logits = x @ self.head_t if self.tied else self.lm_head(x)
        return logits, torch.stack(keys), torch.stack(values)


def export(source: str | None, output: Path, layers: int | None, int8: bool, log=print, target=None) -> Path:
    t0 = time.time()
    if target is None:
        log(f"[export] loading {source or 'the SmolLM2-135M-Instruct GGUF'} ...")
        target = load_target(source, torch.device("cpu"), torch.float32)
    model = target.model
    total = model.config.num_hidden_layers
    n = total if layers is None else layers
    if not 1 <= n <= total:
        raise ValueError(f"--layers must be in 1..{total}, got {n}")
    draft = DraftLM(model, n).eval()
    output.parent.mkdir(parents=True, exist_ok=True)
    fp32 = output.with_name(output.stem + ".fp32.onnx") if int8 else output
    shape = (n, 1, draft.kv_heads, 3, draft.head_dim)
    args = (torch.tensor([[1, 2]]), torch.zeros(shape), torch.zeros(shape))
    log(f"[export] tracing {n} of {total} layers to {fp32} ...")
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            draft, args, str(fp32), dynamo=False, opset_version=17,
            input_names=["input_ids", "past_keys", "past_values"],
            output_names=["logits", "present_keys", "present_values"],
            dynamic_axes={"input_ids": {1: "new"}, "past_keys": {3: "past"}, "past_values": {3: "past"},
                          "logits": {1: "new"}, "present_keys": {3: "total"}, "present_values": {3: "total"}},
        )
    if int8:
        import onnx
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        # Weight-only int8 (blockwise, MatMulNBits): activations stay float, so the outliers of small
        # LMs do not wreck it as dynamic activation quantization does.
        log("[export] quantizing MatMul weights to int8 (weight-only, block 32) ...")
        quant = MatMulNBitsQuantizer(onnx.load(str(fp32)), bits=8, block_size=32, is_symmetric=True,
                                     accuracy_level=4)
        quant.process()
        quant.model.save_model_to_file(str(output), use_external_data_format=False)
        fp32.unlink()
    meta = {
        "source": target.name, "num_layers": n, "source_layers": total, "num_kv_heads": draft.kv_heads,
        "head_dim": draft.head_dim, "vocab_size": target.vocab_size, "eos_token_id": target.eos_token_ids[0],
        "max_positions": int(getattr(model.config, "max_position_embeddings", 8192)), "int8": int8,
        "tokenizer_fingerprint": target.fingerprint,
    }
    output.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    log(f"[export] wrote {output} ({output.stat().st_size / 2**20:.0f} MiB) in {time.time() - t0:.0f}s")
    return output


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", metavar="PATH", help="GGUF file or Hugging Face folder (default: SmolLM2 GGUF)")
    ap.add_argument("--output", required=True, metavar="FILE", help="the .onnx file to write")
    ap.add_argument("--layers", type=int, help="keep only the first N layers (default: all)")
    ap.add_argument("--int8", action="store_true", help="quantize MatMul weights to int8 (ONNX Runtime weight-only MatMulNBits)")
    args = ap.parse_args()
    try:
        export(args.source, Path(args.output), args.layers, args.int8)
    except (FileNotFoundError, ValueError) as err:
        print(f"export_onnx_draft: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
