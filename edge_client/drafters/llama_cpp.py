"""llama.cpp drafter: a small quantized GGUF with its own KV cache, rolled back after each verdict."""

from __future__ import annotations

import numpy as np

from ..models import quiet_native_stderr, resolve_model_path
from ..sampling import SamplingParams, sample, sparse_distribution
from .base import DrafterOptions, Proposal


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


class LlamaCppDrafter:
    name = "llama-cpp"

    def __init__(self, options: DrafterOptions):
        import llama_cpp

        self.path = resolve_model_path(options.model_path)
        kwargs = {"n_threads": options.threads} if options.threads else {}
        with quiet_native_stderr():
            self.llm = llama_cpp.Llama(str(self.path), n_ctx=options.context_size, n_gpu_layers=options.gpu_layers,
                                       logits_all=False, verbose=False, **kwargs)
        self.vocab_size = self.llm.n_vocab()
        self.eos = self.llm.token_eos()
        self.top_k_cap = options.top_k_cap
        self.n_ctx = options.context_size
        self._evaluated: list[int] = []  # tokens whose KV the context holds, in order
        self._logits: np.ndarray | None = None  # next-token logits after the last evaluated token
        self.sampling = SamplingParams()
        self.rng = np.random.default_rng()

    def begin(self, context: list[int], sampling: SamplingParams) -> None:
        self.sampling = sampling
        self.rng = np.random.default_rng(sampling.seed)
        self.accept(context)

    def rollback(self, length: int) -> None:
        """Forget every evaluated token from position `length` on (llama_memory_seq_rm)."""
        if length < len(self._evaluated):
            self.llm._ctx.kv_cache_seq_rm(-1, length, -1)
            self.llm.n_tokens = length
            del self._evaluated[length:]
            self._logits = None

    def _eval(self, tokens: list[int]) -> None:
        self.llm.eval(tokens)
        self._evaluated.extend(tokens)
        self._logits = np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.vocab_size,)).copy()

    def _sync(self, context: list[int]) -> None:
        keep = common_prefix(self._evaluated, context)
        if keep == len(context) == len(self._evaluated) and self._logits is not None:
            return
        keep = min(keep, len(context) - 1)  # the last token is evaluated here to get fresh logits
        self.rollback(keep)
        self._eval(context[keep:])

    def propose(self, context: list[int], k: int) -> Proposal:
        k = min(k, self.n_ctx - len(context) - 1)
        if k <= 0:
            return Proposal([])
        self._sync(context)
        s = self.sampling
        tokens: list[int] = []
        q_ids: list[np.ndarray] = []
        q_probs: list[np.ndarray] = []
        for i in range(k):
            logits = self._logits
            if s.greedy:
                x = int(np.argmax(logits))
            else:
                top_k = min(s.top_k, self.top_k_cap) if s.top_k else self.top_k_cap
                ids, probs = sparse_distribution(logits, s.temperature, top_k, s.top_p)
                x = sample(ids, probs, self.rng)
                q_ids.append(ids)
                q_probs.append(probs)
            tokens.append(x)
            if x == self.eos:
                break
            if i < k - 1:
                self._eval([x])
        if s.greedy:
            return Proposal(tokens)
        return Proposal(tokens, q_ids, q_probs)

    def accept(self, context: list[int]) -> None:
        self.rollback(common_prefix(self._evaluated, context))

    def close(self) -> None:
        self.llm.close()
