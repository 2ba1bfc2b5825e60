"""The device's tokenizer for benchmarks: llama.cpp's where it is installed, else the same vocabulary through
transformers (a GPU machine without llama.cpp)."""

from __future__ import annotations


class TransformersTokenizer:
    """The default GGUF's tokenizer through transformers, for benchmark runs where llama.cpp is not installed
    (a GPU machine): what the benchmarks and `generate` use of the device's tokenizer, same ids and fingerprint."""

    def __init__(self, folder: str | None = None):
        from sled.v1.fingerprint import vocab_fingerprint
        from verify_server.model_loader import vocab_tokens, vocabulary_tokenizer

        self._tok = vocabulary_tokenizer(folder)
        self.vocab_size = len(self._tok)
        self.eos_token_id = self._tok.eos_token_id
        self.fingerprint = vocab_fingerprint(vocab_tokens(self._tok))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def stream_decoder(self) -> "_CumulativeDecoder":
        return _CumulativeDecoder(self)


class _CumulativeDecoder:
    def __init__(self, tokenizer: TransformersTokenizer):
        self._tok, self._ids, self._text = tokenizer, [], ""

    def feed(self, token_ids: list[int]) -> str:
        self._ids += token_ids
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):  # a split UTF-8 sequence: wait for the rest
            return ""
        new, self._text = text[len(self._text):], text
        return new

    def flush(self) -> str:
        text = self._tok.decode(self._ids)
        new, self._text = text[len(self._text):], text
        return new


def device_tokenizer(folder: str | None = None):
    """The device's llama.cpp tokenizer, or the same vocabulary through transformers where llama.cpp is missing or
    a tokenizer folder is given (exported from the GGUF by scripts/export_tokenizer.py)."""
    if folder is not None:
        return TransformersTokenizer(folder)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return TransformersTokenizer()
    from edge_client.tokenizer import Tokenizer

    return Tokenizer()
