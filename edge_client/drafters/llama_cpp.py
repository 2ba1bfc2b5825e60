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
        kwargs = {"n_threads": options.threads} if options.threads else {}
        with quiet_native_stderr():
            self.llm = llama_cpp.Llama(str(self.path), n_ctx=options.context_size, n_gpu_layers=options.gpu_layers,
                                       flash_attn=options.flash_attn, logits_all=False, verbose=False, **kwargs)
        self.vocab_size = self.llm.n_vocab()
        super().__init__(options, self.llm.token_eos(), options.context_size)

    def _eval(self, tokens: list[int]) -> np.ndarray:
        self.llm.eval(tokens)
        return np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.vocab_size,)).copy()

    def _truncate(self, length: int) -> None:
        self.llm._ctx.kv_cache_seq_rm(-1, length, -1)  # llama_memory_seq_rm
        self.llm.n_tokens = length

    def close(self) -> None:
        self.llm.close()
