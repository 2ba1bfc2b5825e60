"""Write a lower-bit copy of a GGUF draft model with llama.cpp's quantize API (a weaker, smaller drafter).

    python scripts/requantize_gguf.py --output drafts/smollm2-q2k.gguf --type q2_k

Tensors whose width does not suit the asked type fall back to what llama.cpp picks (with
SmolLM2-135M most tensors become q4_0: 576 columns is not a multiple of 256).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import llama_cpp


from edge_client.models import quiet_native_stderr, resolve_model_path

TYPES = {"q2_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K, "q3_k_s": llama_cpp.LLAMA_FTYPE_MOSTLY_Q3_K_S,
         "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
         "iq4_nl": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_NL}


def requantize(source: str | Path | None, output: Path, kind: str = "q2_k", threads: int = 2) -> Path:
    if kind not in TYPES:
        raise ValueError(f"type must be one of {', '.join(TYPES)}, got {kind!r}")
    src = resolve_model_path(source)
    output.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = TYPES[kind]
    params.allow_requantize = True
    params.nthread = threads
    with quiet_native_stderr():  # llama.cpp logs every tensor
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(output).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")
    return output


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", metavar="PATH", help="GGUF to requantize (default: the SmolLM2 GGUF)")
    ap.add_argument("--output", required=True, metavar="FILE", help="the GGUF to write")
    ap.add_argument("--type", default="q2_k", choices=sorted(TYPES), help="target quantization (default q2_k)")
    args = ap.parse_args()
    t0 = time.time()
    try:
        out = requantize(args.source, Path(args.output), args.type)
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        print(f"requantize_gguf: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) in {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
