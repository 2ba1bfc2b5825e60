"""sled-train: train a drafter for a target and write it as an ONNX model that a device drafts with.

    sled-train imitation --layers 8 --output drafts/imitation.onnx      # device: --drafter onnx --onnx-model ...
    sled-train parallel --heads 4 --output drafts/parallel.onnx         # device: --drafter parallel --onnx-model ...
    sled-train parallel --heads 4 --loss ctc --output drafts/ctc.onnx

The data is self-distillation: the target's own greedy answers to prompts of corpora that install with the project
(HumanEval's stubs, the Python reference's passages) and chat requests built on the target's vocabulary; a hashed
share of the prompts is held out and never trained on. Work (the distilled data, shared by drafters trained into one
folder, and checkpoints) goes to sled-train.work beside the output; --resume goes on from the last checkpoint.
Beside the model: its .json (what the device reads) and a model card (.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from datetime import datetime, timezone

DEFAULTS = dict(layers=8, head_layers=1, heads=4, prompts=480, eval_prompts=24, max_new_tokens=96, batch=4,
                anchors=32)
# by kind: a parallel head starts from an imitation head (--init) and trains its slots, in fewer steps
KIND_DEFAULTS = {"imitation": dict(steps=1200, lr=1e-3), "parallel": dict(steps=600, lr=1e-3)}


def positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value
    return parse


def fraction(text):
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sled-train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="kind", required=True, metavar="{imitation,parallel}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--output", required=True, metavar="FILE", help="the .onnx model to write")
    common.add_argument("--target", metavar="PATH", help="the target: GGUF file or Hugging Face folder (default: "
                        "the SmolLM2-135M-Instruct GGUF)")
    common.add_argument("--backbone", metavar="PATH", help="draft on this smaller model's first layers instead of "
                        "the target's (it must share the target's tokenizer)")
    common.add_argument("--layers", type=positive(int), default=DEFAULTS["layers"], metavar="L",
                        help=f"backbone layers the drafter runs (default {DEFAULTS['layers']})")
    common.add_argument("--head-layers", type=positive(int), default=DEFAULTS["head_layers"], metavar="N",
                        help=f"trained blocks on the backbone (default {DEFAULTS['head_layers']})")
    common.add_argument("--corpus", default="humaneval,pydoc,chat", help="comma-separated prompt corpora: "
                        "humaneval (HumanEval's stubs), pydoc (the Python reference), chat (requests to explain, list, "
                        "tell or write code about common words of the target's vocabulary); default all three")
    common.add_argument("--prompts", type=positive(int), default=DEFAULTS["prompts"],
                        help=f"training prompts (default {DEFAULTS['prompts']})")
    common.add_argument("--eval-prompts", type=positive(int), default=DEFAULTS["eval_prompts"],
                        help=f"held-out prompts for the card's acceptance (default {DEFAULTS['eval_prompts']})")
    common.add_argument("--heldout-fraction", type=fraction, default=0.1,
                        help="the share of the corpus held out, by a hash of each prompt (default 0.1)")
    common.add_argument("--max-new-tokens", type=positive(int), default=DEFAULTS["max_new_tokens"],
                        help=f"tokens of the target's answer to each prompt (default {DEFAULTS['max_new_tokens']})")
    common.add_argument("--steps", type=positive(int), help="optimizer steps (default: imitation "
                        f"{KIND_DEFAULTS['imitation']['steps']}, parallel {KIND_DEFAULTS['parallel']['steps']})")
    common.add_argument("--batch", type=positive(int), default=DEFAULTS["batch"],
                        help=f"sequences a step (default {DEFAULTS['batch']})")
    common.add_argument("--lr", type=positive(float), help="peak learning rate (AdamW, cosine decay; default: "
                        f"imitation {KIND_DEFAULTS['imitation']['lr']}, parallel {KIND_DEFAULTS['parallel']['lr']})")
    common.add_argument("--seed", type=int, default=0, help="seed of the split, batches and initialisation")
    common.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where training runs")
    common.add_argument("--threads", type=positive(int), help="torch threads on the CPU (default: torch's)")
    common.add_argument("--int8", action="store_true", help="quantize the ONNX model's weights to int8")
    common.add_argument("--save-every", type=positive(int), default=50, metavar="STEPS",
                        help="checkpoint interval (default 50)")
    common.add_argument("--resume", action="store_true", help="go on from the work folder's last checkpoint")
    common.add_argument("--work", metavar="DIR", help="work folder (default: sled-train.work beside OUTPUT)")
    im = sub.add_parser("imitation", parents=[common], help="FastVLM's imitation network on the first L layers",
                        description="Blocks trained on the backbone's layer L so its early exit imitates the "
                        "target's next-token distribution (KL to the target; --hidden-weight adds matching of the "
                        "target's last hidden state). The device drafts with --drafter onnx.")
    im.add_argument("--hidden-weight", type=float, default=0.0, metavar="W",
                    help="weight of the hidden-state matching loss (mean squared error; default 0: KL only)")
    par = sub.add_parser("parallel", parents=[common], help="K tokens from one forward (SpecFormer block; CE or CTC)",
                         description="S slots attend causally to the context and bidirectionally to each other; "
                         "one forward drafts K tokens. The device drafts with --drafter parallel.")
    par.add_argument("--heads", type=positive(int), default=DEFAULTS["heads"], metavar="K",
                     help=f"tokens a forward drafts (default {DEFAULTS['heads']})")
    par.add_argument("--loss", choices=("ce", "ctc"), default="ce",
                     help="per-position cross-entropy (ce, default) or CTC over the slots with blank and repeat "
                     "collapse (ctc)")
    par.add_argument("--slots", type=positive(int), metavar="S",
                     help="query slots (default: K for ce; K + K/2 for ctc, room for blanks and repeats)")
    par.add_argument("--init", metavar="CHECKPOINT",
                     help="start the blocks from a sled-train imitation checkpoint of the same --layers and "
                     "--head-layers (its work folder's NAME.checkpoint.pt): slot 0 then starts as that head")
    par.add_argument("--anchors", type=positive(int), default=DEFAULTS["anchors"],
                     help=f"context ends trained a sequence a step (default {DEFAULTS['anchors']})")
    return p


def parse(argv=None) -> argparse.Namespace:
    """The command line's settings, with the defaults that depend on others filled in; ValueError if they clash."""
    args = build_parser().parse_args(argv)
    for name, value in KIND_DEFAULTS[args.kind].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.kind == "parallel":
        if args.heads < 2:
            raise ValueError("--heads must be at least 2: one token a forward is `sled-train imitation`")
        if args.loss == "ce" and args.slots not in (None, args.heads):
            raise ValueError(f"--loss ce trains one slot a token: --slots must be --heads ({args.heads}) or unset")
        args.slots = args.slots or (args.heads + args.heads // 2 if args.loss == "ctc" else args.heads)
        if args.slots < args.heads:
            raise ValueError(f"--slots ({args.slots}) must be at least --heads ({args.heads})")
    return args


def main(argv=None) -> int:
    try:
        args = parse(argv)
        from .train import train
        train(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"sled-train: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sled-train: stopped; --resume goes on from the last checkpoint", file=sys.stderr)
        return 130
    return 0


def key_of(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def now() -> str:
    return f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}"


def cosine(step: int, steps: int, warmup: int = 20) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


if __name__ == "__main__":
    sys.exit(main())
