"""The tokenizer fingerprint rule of the wire contract (Open.tokenizer_fingerprint), shared by both sides."""

import hashlib


def vocab_fingerprint(tokens: list[str]) -> str:
    """sha256 over the vocabulary: each token's UTF-8 text, length-prefixed, in id order."""
    h = hashlib.sha256(b"sled-vocab-v1")
    h.update(len(tokens).to_bytes(4, "little"))
    for text in tokens:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    return "sha256:" + h.hexdigest()
