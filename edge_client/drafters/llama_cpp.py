"""llama.cpp drafter: a small quantized GGUF with its own KV cache, rolled back after each verdict."""

from __future__ import annotations

import numpy as np

from ..models import quiet_native_stderr, resolve_model_path
from .base import DrafterOptions
from .kv_drafter import KVDrafter


class LlamaCppDrafter(KVDrafter):
    name = "llama-cpp"

    def __init__(self, options: DrafterOptions):
        import llama_cpp

        self.path = resolve_model_path(options.model_path)
        # threads bounds prompt batches too: llama.cpp would otherwise spin a thread per core on them
        kwargs = {"n_threads": options.threads, "n_threads_batch": options.threads} if options.threads else {}
        with quiet_native_stderr():
            self.llm = llama_cpp.Llama(str(self.path), n_ctx=options.context_size, n_gpu_layers=options.gpu_layers,
                                       flash_attn=options.flash_attn, logits_all=False, verbose=False, **kwargs)
        self.vocab_size = self.llm.n_vocab()
        super().__init__(options, self.llm.token_eos(), options.context_size)

    def _eval(self, tokens: list[int]) -> np.ndarray:
        self.llm.eval(tokens)
        return np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.vocab_size,)).copy()

    def _eval_rows(self, tokens: list[int]) -> np.ndarray:
        """Logits after each of `tokens` from one decode a batch: llama's eval() keeps the last row only."""
        llm, rows = self.llm, []
        llm._ctx.kv_cache_seq_rm(-1, llm.n_tokens, -1)
        for start in range(0, len(tokens), llm.n_batch):
            chunk = tokens[start:start + llm.n_batch]
            llm._batch.set_batch(batch=chunk, n_past=llm.n_tokens, logits_all=True)
            llm._ctx.decode(llm._batch)
            llm.input_ids[llm.n_tokens:llm.n_tokens + len(chunk)] = chunk
            llm.n_tokens += len(chunk)
            rows.append(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(len(chunk), self.vocab_size)).copy())
        return np.concatenate(rows)

    def _truncate(self, length: int) -> None:
        self.llm._ctx.kv_cache_seq_rm(-1, length, -1)  # llama_memory_seq_rm
        self.llm.n_tokens = length

    def close(self) -> None:
        self.llm.close()
