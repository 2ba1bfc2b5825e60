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
from pathlib import Path

import torch

from sled_train.graph import DraftGraph, blocks_of, write_onnx
from verify_server.model_loader import load_target


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
    draft = DraftGraph(model, blocks_of(model, n)).eval()
    write_onnx(draft, output, ("logits", "present_keys", "present_values"), int8, log)
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
