"""Limits of the wire contract that both sides apply the same way."""

import struct

# A temperature below this samples as greedy (as vLLM's 1e-5): dividing logits by a smaller one
# overflows float32 and gives NaN probabilities. 2**-17 is exact in float32, and both sides compare
# the float32 value the wire carries, so they agree on every temperature.
MIN_TEMPERATURE = 2.0 ** -17


def greedy_temperature(temperature: float) -> bool:
    """Whether a temperature samples as greedy, judged on its float32 wire value."""
    return float(struct.unpack("f", struct.pack("f", temperature))[0]) < MIN_TEMPERATURE

# Stop token ids an Open may carry besides the target's EOS.
MAX_STOP_TOKENS = 256

# Bytes of an Open's constraint text (sled.constraints): a large schema compiles for seconds.
MAX_CONSTRAINT_BYTES = 64 * 1024

# Room for an Open's strings (fingerprint, client id, auth token) and each message's framing.
_STRINGS_BYTES = 4096
_VARINT_BYTES = 5  # a uint32 at most
_FLOAT_BYTES = 4


def max_message_bytes(max_seq_len: int, max_draft_tokens: int, max_draft_top_k: int) -> int:
    """The largest client message a server with these settings can take: its receive limit. Anything larger is
    refused by gRPC before it is decoded."""
    open_ = _VARINT_BYTES * (max_seq_len + MAX_STOP_TOKENS) + MAX_CONSTRAINT_BYTES + _STRINGS_BYTES
    entries = max_draft_tokens * max_draft_top_k
    draft = (_VARINT_BYTES * (2 * max_draft_tokens + 1 + entries) + _FLOAT_BYTES * entries + _STRINGS_BYTES)
    return max(open_, draft) + _STRINGS_BYTES
