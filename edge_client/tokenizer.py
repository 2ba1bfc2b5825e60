"""The device's tokenizer: llama.cpp's, read from a GGUF without loading the weights."""

from __future__ import annotations

import codecs
import functools
import warnings
from pathlib import Path

import jinja2.meta
import jinja2.sandbox

from sled.v1.fingerprint import vocab_fingerprint

from .models import quiet_native_stderr, resolve_model_path


class Tokenizer:
    def __init__(self, model_path: str | Path | None = None):
        import llama_cpp  # here, not at module level: generation and transport run without llama.cpp

        self.path = resolve_model_path(model_path)
        with quiet_native_stderr():
            self._llm = llama_cpp.Llama(str(self.path), vocab_only=True, verbose=False)
        self.vocab_size = self._llm.n_vocab()
        self.eos_token_id = self._llm.token_eos()
        self.bos_token_id = self._llm.token_bos()
        self._fingerprint: str | None = None

    @property
    def vocab_tokens(self) -> list[str]:
        model = self._llm._model
        return [model.token_get_text(i) for i in range(self.vocab_size)]

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = vocab_fingerprint(self.vocab_tokens)
        return self._fingerprint

    def encode(self, text: str) -> list[int]:
        # add_bos defers to the GGUF's add_bos_token; special tokens in the text are parsed.
        return self._llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)

    @functools.cached_property
    def grammar_tokenizer(self):
        """This vocabulary as llguidance reads it (for a request's constraint), built at first use: about a second."""
        from llguidance.llamacpp import lltokenizer_from_vocab

        with warnings.catch_warnings():  # it reads each token through a llama.cpp call marked deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            return lltokenizer_from_vocab(self._llm._model.vocab)

    def token_bytes(self, token_id: int) -> bytes:
        return self._llm.detokenize([token_id], special=False)

    def decode(self, token_ids: list[int]) -> str:
        return self._llm.detokenize(token_ids, special=False).decode("utf-8", errors="replace")

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)

    @property
    def chat_template(self) -> str | None:
        return self._llm.metadata.get("tokenizer.chat_template") or None

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
                    ) -> str:
        if not self.chat_template:
            raise ValueError(f"{self.path.name} carries no chat template")
        return render_chat(self.chat_template, messages, add_generation_prompt, tools)


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template), "tools" in jinja2.meta.find_undeclared_variables(env.parse(template))


def takes_tools(template: str) -> bool:
    """Whether a chat template renders the tools itself (it reads a `tools` variable)."""
    return _compiled(template)[1]


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> str:
    return _compiled(template)[0].render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token="", eos_token="", tools=tools or None)


class StreamDecoder:
    """Turns committed token ids into text as they arrive, holding back split UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: list[int]) -> str:
        return self._utf8.decode(b"".join(self._tok.token_bytes(t) for t in token_ids))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
