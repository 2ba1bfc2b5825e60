"""sled-train's procedure: distil, train with checkpoints, evaluate on held-out prompts, export, write the card."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import data as D
from .cli import cosine, key_of, now
from .graph import check_family, write_onnx
from .heads import ImitationHead, ParallelHead, ctc_collapse, ctc_loss, soft_cross_entropy

MAX_LEN = 512  # tokens of a sequence trained on
EVAL_K = 4  # the draft length the card's acceptance is measured at


def log(msg: str) -> None:
    print(msg, flush=True)


def train(args, target=None) -> dict:
    """Runs `sled-train` with parsed arguments; `target` is the loaded target when the caller has it already."""
    started = time.time()
    out = Path(args.output)
    if out.suffix != ".onnx":
        raise ValueError(f"--output must name an .onnx file, got {out}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here")
    device = torch.device(args.device)
    work = Path(args.work) if args.work else out.parent / "sled-train.work"  # drafters made side by side share data
    work.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    from verify_server.model_loader import load_target

    if target is None:
        log(f"[train] loading the target {args.target or '(SmolLM2-135M-Instruct GGUF)'} ...")
        target = load_target(args.target, torch.device("cpu"), torch.float32)
    check_family(target.model.config)
    backbone = target
    if args.backbone:
        log(f"[train] loading the backbone {args.backbone} ...")
        backbone = load_target(args.backbone, torch.device("cpu"), torch.float32)
        check_family(backbone.model.config)
        if backbone.fingerprint != target.fingerprint:
            raise ValueError(f"--backbone {args.backbone} has another tokenizer than the target")
    total = backbone.model.config.num_hidden_layers
    if args.layers > total:
        raise ValueError(f"--layers must be in 1..{total} (the backbone's layers), got {args.layers}")
    train_set, eval_set, data_s, eval_prompts = dataset(args, target, backbone, work)
    bmodel = backbone.model
    if args.kind == "imitation":
        head = ImitationHead(bmodel, args.layers, args.head_layers)
    else:
        head = ParallelHead(bmodel, args.layers, args.head_layers, args.slots, args.loss == "ctc", args.seed)
    if getattr(args, "init", None):
        start_from(head, Path(args.init), args)
    head.to(device)
    config = {"kind": args.kind, "layers": args.layers, "head_layers": args.head_layers, "data": data_s["key"],
              "slots": getattr(args, "slots", None), "loss": getattr(args, "loss", "kl"), "steps": args.steps,
              "batch": args.batch, "lr": args.lr, "seed": args.seed, "hidden_weight": getattr(args, "hidden_weight", 0),
              "anchors": getattr(args, "anchors", None), "heads": getattr(args, "heads", None),
              "init": getattr(args, "init", None)}
    train_s, losses = fit(args, head, train_set, config, work / f"{out.stem}.checkpoint.pt", device)
    head.eval()
    log("[train] measuring acceptance on the held-out prompts ...")
    with torch.inference_mode():
        held = evaluate(head, eval_set, device)
    head.cpu()
    graph = head.graph(bmodel).eval()
    names = ("logits" if args.kind == "imitation" else "slot_logits", "present_keys", "present_values")
    write_onnx(graph, out, names, args.int8, log)
    meta = {
        "kind": "autoregressive" if args.kind == "imitation" else "parallel", "source": backbone.name,
        "target": target.name, "num_layers": len(graph.blocks), "source_layers": total,
        "num_kv_heads": graph.kv_heads, "head_dim": graph.head_dim, "vocab_size": target.vocab_size,
        "eos_token_id": target.eos_token_ids[0], "eos_token_ids": list(target.eos_token_ids),
        "max_positions": int(getattr(bmodel.config, "max_position_embeddings", 8192)), "int8": args.int8,
        "tokenizer_fingerprint": target.fingerprint, "trained": config, "held_out": held,
        "held_out_prompts": eval_prompts,  # never trained on: what `sled-bench drafters --trained` runs as held-out
    }
    if args.kind == "parallel":
        meta |= {"slots": args.slots, "heads": args.heads, "loss": args.loss,
                 "blank_id": target.vocab_size if args.loss == "ctc" else None}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    report = {"data": data_s, "train": train_s, "held_out": held, "loss_first": losses[:1], "loss_last": losses[-10:],
              "total_s": time.time() - started}
    out.with_suffix(".md").write_text(card(args, meta, report))
    (work / f"{out.stem}.report.json").write_text(json.dumps(report, indent=2))
    log(f"[train] wrote {out} ({out.stat().st_size / 2**20:.0f} MiB), {out.with_suffix('.json').name} and "
        f"{out.with_suffix('.md').name} in {report['total_s'] / 60:.1f} min; held-out mean acceptance length at "
        f"K = {EVAL_K}: {held['mean_acceptance_length']:.2f}"
        + (f" (untrained early exit: {held['untrained']['mean_acceptance_length']:.2f})" if "untrained" in held else ""))
    return report


def start_from(head, path: Path, args) -> None:
    """Loads an imitation checkpoint's blocks into a parallel head (its slots and blank stay as initialised)."""
    if not path.is_file():
        raise FileNotFoundError(f"--init: {path} does not exist")
    state = torch.load(path, weights_only=False)
    made = state.get("config", {})
    if made.get("kind") != "imitation" or (made.get("layers"), made.get("head_layers")) != (args.layers,
                                                                                              args.head_layers):
        raise ValueError(f"--init: {path} is not an imitation checkpoint with --layers {args.layers} and "
                         f"--head-layers {args.head_layers}")
    blocks = {k: v for k, v in state["head"].items() if k.startswith("blocks.")}
    missing = [k for k in head.load_state_dict(blocks, strict=False).missing_keys if k.startswith("blocks.")]
    if missing or not blocks:
        raise ValueError(f"--init: {path} lacks the blocks {', '.join(missing) or 'all of them'}")
    log(f"[train] blocks from {path} (step {state['step']})")


def dataset(args, target, backbone, work: Path):
    """The training and held-out features, from the work folder when its key matches, else distilled now."""
    fields = {"target": target.name, "fingerprint": target.fingerprint, "backbone": backbone.name,
              "layers": args.layers, "corpus": args.corpus, "prompts": args.prompts, "eval": args.eval_prompts,
              "heldout": args.heldout_fraction, "max_new": args.max_new_tokens, "seed": args.seed,
              "version": 2}
    key = key_of(fields)
    prompts = D.corpus([c for c in args.corpus.split(",") if c], target.vocab_tokens)
    train_p, eval_p = D.split(prompts, args.heldout_fraction, args.prompts, args.eval_prompts, args.seed)
    path = work / f"data-{key}.pt"
    if path.is_file():
        try:
            saved = torch.load(path, weights_only=False)
            if saved.get("key") == key:
                log(f"[train] distilled data from {path}")
                return saved["train"], saved["eval"], saved["stats"] | {"reused": True}, eval_p
        except Exception as err:  # a torn or foreign file: made again, never trusted
            log(f"[train] {path} is unreadable ({type(err).__name__}); distilling again")
    tok = target.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise ValueError("the target's tokenizer has no chat template to put the prompts in")

    def encode(prompt: str) -> list[int]:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    start = time.time()

    if len(train_p) < args.prompts or len(eval_p) < args.eval_prompts:
        log(f"[train] the corpus gives {len(train_p)} training and {len(eval_p)} held-out prompts")
    if not train_p or not eval_p:
        raise ValueError("the corpus leaves no training or no held-out prompts; change --corpus or "
                         "--heldout-fraction")
    seqs = {}
    for name, ps in (("train", train_p), ("eval", eval_p)):
        with tqdm(total=len(ps), desc=f"distilling ({name})", unit="prompt") as bar:
            seqs[name] = D.distill(target.model, encode, ps, args.max_new_tokens, 8, target.eos_token_ids,
                                   bar.update)
    feats = {}
    for name, ss in seqs.items():
        with tqdm(total=len(ss), desc=f"features ({name})", unit="seq") as bar:
            feats[name] = D.features(target.model, backbone.model, args.layers, ss, bar.update)
    stats = {"key": key, "corpus": args.corpus, "train_prompts": len(train_p), "eval_prompts": len(eval_p),
             "train_tokens": sum(len(f.ids) for f in feats["train"]),
             "answer_tokens": sum(len(f.ids) - f.prompt_len for f in feats["train"]), "seconds": time.time() - start}
    tmp = path.with_suffix(".tmp")
    torch.save({"key": key, "train": feats["train"], "eval": feats["eval"], "stats": stats}, tmp)
    os.replace(tmp, path)
    return feats["train"], feats["eval"], stats, eval_p


def pad(rows: list[torch.Tensor], value=0) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)


def pick(step: int, seed: int, n: int, batch: int) -> list[int]:
    """The sequences of a step: a function of the seed and the step alone, so a resumed run repeats exactly."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randperm(n, generator=g)[:batch].tolist()


def anchors_of(f: D.Features, k: int) -> torch.Tensor:
    """Context ends whose next k tokens are the target's answer: the last prompt token up to k before the end."""
    end = min(len(f.ids), MAX_LEN) - 1 - k
    return torch.arange(f.prompt_len - 1, end + 1)


def imitation_loss(args, head, x, rows: list[D.Features], device) -> torch.Tensor:
    """The KL to the target over the answers' rows (from the prompt's last row): a device drafts there, never in a
    prompt. x: the head's normed rows [B, T, hidden]."""
    lengths = torch.tensor([min(len(f.ids), MAX_LEN) for f in rows])
    starts = torch.tensor([f.prompt_len - 1 for f in rows])
    at = torch.arange(x.shape[1])[None]
    valid = ((at >= starts[:, None]) & (at < lengths[:, None])).to(device)
    x = x[valid]
    top_ids = pad([f.top_ids[:MAX_LEN] for f in rows]).to(device)[valid]
    top_probs = pad([f.top_probs[:MAX_LEN] for f in rows]).to(device)[valid]
    loss = soft_cross_entropy(head.logits(x), top_ids, top_probs).mean()
    if getattr(args, "hidden_weight", 0):
        final = pad([f.final[:MAX_LEN] for f in rows]).to(device)[valid].float()
        loss = loss + args.hidden_weight * F.mse_loss(x, final)
    return loss


def step_loss(args, head, rows: list[D.Features], step: int, device) -> torch.Tensor:
    hidden = pad([f.hidden[:MAX_LEN] for f in rows]).to(device)
    if args.kind == "imitation":
        return imitation_loss(args, head, head(hidden), rows, device)
    k, g = args.heads, torch.Generator().manual_seed(args.seed * 1_000_003 + step + 7)
    anchors = []
    for f in rows:
        choices = anchors_of(f, k)
        anchors.append(choices[torch.randint(len(choices), (args.anchors,), generator=g)])
    at = [torch.stack([a + j for j in range(k)], dim=-1) for a in anchors]  # [A, K]: slot j's position
    anchors = torch.stack(anchors).to(device)  # [B, A]
    slots, context = head(hidden, anchors)
    logits = head.slot_logits(slots)  # [B, A, S, V (+1)]
    # slot 0 is an anchor's own row: every answer row is trained as the imitation head's are
    first = imitation_loss(args, head, context, rows, device)
    if args.loss == "ce":  # slot j against the target's distribution after the answer up to anchor + j
        top_ids = torch.stack([f.top_ids[a] for f, a in zip(rows, at)]).to(device)  # [B, A, K, TOP_K]
        top_probs = torch.stack([f.top_probs[a] for f, a in zip(rows, at)]).to(device)
        return first + soft_cross_entropy(logits[:, :, :k], top_ids, top_probs).mean()
    targets = torch.stack([f.ids[a + 1] for f, a in zip(rows, at)]).to(device)  # [B, A, K]: the answer's tokens
    blank = logits.shape[-1] - 1
    return first + ctc_loss(logits.reshape(-1, *logits.shape[2:]), targets.reshape(-1, k), blank).mean()


def fit(args, head, feats, config, ckpt: Path, device):
    """AdamW with warm-up and cosine decay; a checkpoint every --save-every steps and at the end."""
    if args.kind == "parallel":
        feats = [f for f in feats if len(anchors_of(f, args.heads))]
    if not feats:
        raise ValueError("no training sequence is long enough; raise --max-new-tokens")
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    step, losses, before = 0, [], 0.0  # before: training seconds of the runs this one resumes
    if args.resume:
        if not ckpt.is_file():
            raise FileNotFoundError(f"--resume: {ckpt} does not exist")
        state = torch.load(ckpt, weights_only=False)
        if state["config"] != config:
            diff = sorted(k for k in config if state["config"].get(k) != config[k])
            raise ValueError(f"--resume: {ckpt} was trained with other settings ({', '.join(diff)}); use another "
                             "--work or the same settings")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optim"])
        step, losses, before = state["step"], state["losses"], state.get("seconds", 0.0)
        log(f"[train] resumed at step {step} of {args.steps}")
    elif ckpt.is_file():
        raise ValueError(f"{ckpt} exists; pass --resume to go on from it, or give another --work")
    else:
        torch.manual_seed(args.seed)
    start = time.time()
    head.train()
    with tqdm(total=args.steps, initial=step, desc=f"training ({args.kind})", unit="step") as bar:
        while step < args.steps:
            for group in opt.param_groups:
                group["lr"] = args.lr * cosine(step, args.steps)
            loss = step_loss(args, head, [feats[i] for i in pick(step, args.seed, len(feats), args.batch)], step,
                             device)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            losses.append(round(loss.item(), 4))
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
            bar.update()
            if step % args.save_every == 0 or step == args.steps:
                tmp = ckpt.with_suffix(".tmp")
                torch.save({"config": config, "head": head.state_dict(), "optim": opt.state_dict(), "step": step,
                            "losses": losses, "seconds": before + time.time() - start}, tmp)
                os.replace(tmp, ckpt)
    return {"steps": step, "seconds": before + time.time() - start}, losses


def runs(drafted: list[list[int]], truth: list[list[int]]) -> list[int]:
    """How many of each draft's tokens a greedy verifier keeps: the run that agrees with the target's tokens."""
    out = []
    for d, t in zip(drafted, truth):
        n = 0
        while n < len(d) and n < len(t) and d[n] == t[n]:
            n += 1
        out.append(n)
    return out


def summarize(kept: list[int], k: int) -> dict:
    n = max(1, len(kept))
    return {"anchors": len(kept), "mean_acceptance_length": 1 + sum(kept) / n,
            "acceptance_by_position": [sum(r > j for r in kept) / n for j in range(k)]}


def evaluate(head, feats: list[D.Features], device, k: int = EVAL_K) -> dict:
    """Greedy acceptance on the held-out answers, exactly as a greedy verifier scores drafts there: a draft from
    each context end in the answer is kept up to its first token that differs from the target's."""
    kept, base = [], []
    for f in feats:
        ids = f.ids[:MAX_LEN]
        hidden = f.hidden[:MAX_LEN][None].to(device)
        anchors = torch.arange(f.prompt_len - 1, len(ids) - 1)
        if not len(anchors):
            continue
        truth = [ids[a + 1:a + 1 + k].tolist() for a in anchors]
        if isinstance(head, ImitationHead):
            # teacher-forced: while a draft agrees with the answer its context is the answer's
            choice = head.logits(head(hidden))[0].argmax(-1).cpu()
            early = head.logits(head.norm(hidden))[0].argmax(-1).cpu()
            kept += runs([choice[a:a + k].tolist() for a in anchors], truth)
            base += runs([early[a:a + k].tolist() for a in anchors], truth)
        else:
            logits = head.slot_logits(head(hidden, anchors[None].to(device))[0])[0]  # [A, S, V (+1)]
            choice = logits.argmax(-1).cpu().tolist()
            if head.blank is not None:
                choice = [ctc_collapse(c, logits.shape[-1] - 1)[:k] for c in choice]
            kept += runs([c[:k] for c in choice], truth)
    out = summarize(kept, k)
    if base:
        out["untrained"] = summarize(base, k)
    return out


def card(args, meta: dict, report: dict) -> str:
    held, data, tr = report["held_out"], report["data"], report["train"]
    by_pos = ", ".join(f"{p:.2f}" for p in held["acceptance_by_position"])
    kind = ("imitation network (FastVLM) on the backbone's first "
            f"{args.layers} layers, {args.head_layers} trained block(s); device: `--drafter onnx`"
            if args.kind == "imitation" else
            f"parallel draft block (SpecFormer), {args.slots} slots, {args.heads} tokens a forward, loss "
            f"{args.loss}; device: `--drafter parallel`")
    lines = [
        f"# Drafter card: {Path(args.output).name}", "",
        f"- kind: {kind}",
        f"- target: {meta['target']}; backbone: {meta['source']} ({meta['num_layers']} blocks in the ONNX model"
        f"{', int8 weights' if args.int8 else ''})",
        f"- data: self-distillation, the target's greedy answers ({args.max_new_tokens} tokens at most) to "
        f"{data['train_prompts']} prompts of {data['corpus']} ({data['train_tokens']} tokens, "
        f"{data['answer_tokens']} of them answers); {data['eval_prompts']} held-out prompts (by hash, never "
        "trained on)",
        f"- training: {tr['steps']} steps of {args.batch} sequences, AdamW at {args.lr} (cosine), seed {args.seed}, "
        f"on {args.device}; loss {report['loss_first'][0] if report['loss_first'] else '?'} at the first step, "
        f"{sum(report['loss_last']) / max(1, len(report['loss_last'])):.3f} over the last 10",
        f"- time: {'the distilled data reused from the work folder (made in ' if data.get('reused') else 'distilling '}"
        f"{data['seconds'] / 60:.1f} min{')' if data.get('reused') else ''}, training {tr['seconds'] / 60:.1f} min, "
        f"{report['total_s'] / 60:.1f} min in all",
        f"- held-out acceptance (greedy, K = {EVAL_K}, {held['anchors']} drafts): mean acceptance length "
        f"{held['mean_acceptance_length']:.2f}; share of drafts whose first 1..{EVAL_K} tokens are all kept: {by_pos}",
    ]
    if "untrained" in held:
        u = held["untrained"]
        lines.append(f"- the untrained early exit (the backbone's layer {args.layers} into the final norm and head): "
                     f"mean acceptance length {u['mean_acceptance_length']:.2f}; by position "
                     + ", ".join(f"{p:.2f}" for p in u["acceptance_by_position"]))
    lines += ["", f"Made by `sled-train {args.kind}` on {now()}. Verification stays lossless whatever this drafter "
              "proposes: it only changes how many tokens a round keeps."]
    return "\n".join(lines) + "\n"
