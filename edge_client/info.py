"""`sled-edge info`: what a verify server serves and how it has done since it started, for people or as JSON."""

from __future__ import annotations

import asyncio
import json
import sys

from .servers import resolve, split_servers
from .transport import TLS, VerifyError, fetch_info


def channel_tls(args) -> TLS | None:
    """The TLS flags of `generate` and `info` as the client's TLS settings, or None for a plain connection."""
    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key):
        if args.tls_server_name:
            raise ValueError("--tls-server-name applies to TLS: give --tls (or --tls-ca)")
        return None
    return TLS.load(args.tls_ca, args.tls_server_name, args.tls_cert, args.tls_key)


def describe_kernels(info) -> str:
    """How a verify server runs its target, from its Info: device, dtype, kernels, and the fused CPU step's range."""
    fused = (f"the fused CPU step for steps of up to {info.fused_max_tokens} tokens" if info.fused_max_tokens
             else "no fused CPU step")
    return f"{info.device} {info.dtype}, {info.attention} attention, {info.linear} linear; {fused}"


def describe_info(info) -> str:
    """A verify server's Info, for people."""
    st = info.stats
    lines = [f"target: {info.target_name}",
             f"vocabulary: {info.vocab_size} tokens (fingerprint {info.tokenizer_fingerprint[:16]}), "
             f"EOS {', '.join(map(str, info.eos_token_ids)) or 'none'}",
             f"limits: context {info.context_limit} tokens, drafts of up to {info.max_draft_tokens} tokens, "
             f"{info.max_sessions} sessions ({st.active_sessions} open, {st.free_slots} more may open)"]
    if st.kv_blocks_total:  # a server older than the paged pool leaves it 0
        lines.append(f"KV pool: {st.kv_blocks_total} blocks of {st.kv_block_size} tokens: {st.kv_blocks_used} used, "
                     f"{st.kv_blocks_free} free, {st.kv_blocks_shared} shared by several sessions, "
                     f"{st.kv_blocks_cached} holding a cached prefix")
    if info.device:  # a server older than the kernel fields leaves them empty
        lines.append(f"kernels: {describe_kernels(info)}")
    line = f"since start: {st.sessions_opened} sessions, {st.steps} steps, {st.verifications} verifications"
    if st.steps:
        line += (f"; per step {st.step_seconds_total / st.steps * 1000:.1f} ms "
                 f"(forward {st.forward_seconds_total / st.steps * 1000:.1f} ms), most sessions in one step "
                 f"{st.max_step_sessions}")
    lines.append(line)
    if st.verifications:
        lines.append(f"verification: {st.queue_wait_seconds_total / st.verifications * 1000:.1f} ms mean queue wait; "
                     f"{st.emitted_tokens} tokens emitted")
    if st.draft_tokens:
        lines.append(f"drafts: {st.drafts} with tokens, {st.draft_tokens} tokens drafted, {st.accepted_tokens} "
                     f"accepted (acceptance {st.accepted_tokens / st.draft_tokens:.2f})"
                     + (f", {st.loosely_accepted_tokens} of them by a loose rule" if st.loosely_accepted_tokens else ""))
    if st.prefill_tokens or st.prefix_cache_hit_tokens:
        lines.append(f"prefill: {st.prefill_tokens} prompt tokens computed, {st.prefix_cache_hit_tokens} shared from "
                     "cached prefix blocks")
    return "\n".join(lines)


def _plain(msg) -> dict:
    """A message as a dict of its fields, every field present, counters as numbers (protobuf's own JSON mapping
    writes 64-bit integers as strings)."""
    out = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        convert = _plain if field.message_type is not None else (lambda v: v)
        out[field.name] = [convert(v) for v in value] if _repeated(field) else convert(value)
    return out


def _repeated(field) -> bool:
    """Whether a field is repeated: `is_repeated` where protobuf has it (6.31 on, which drops `label`), else `label`."""
    flag = getattr(field, "is_repeated", None)
    return flag if flag is not None else field.label == field.LABEL_REPEATED


def main_info(args) -> int:

    if not args.timeout > 0:
        print("sled-edge info: --timeout must be > 0", file=sys.stderr)
        return 2
    try:
        tls = channel_tls(args)
        entries, dns = split_servers(args.server)
        addresses = asyncio.run(resolve(entries[0])) if dns else entries
    except (ValueError, OSError) as err:
        print(f"sled-edge info: {err}", file=sys.stderr)
        return 2
    answers, rc = [], 0
    for address in addresses:  # each server of a fleet answers for itself
        try:
            info = asyncio.run(fetch_info(address, args.timeout, tls))
        except VerifyError as err:
            if err.code == "DEADLINE_EXCEEDED":  # nothing listens there, or nothing reaches it
                print(f"sled-edge info: no answer from {address} within {args.timeout:g}s ({err.message})",
                      file=sys.stderr)
            else:  # e.g. UNAVAILABLE while the model loads
                print(f"sled-edge info: {address} answered {err}", file=sys.stderr)
            rc = 1
            continue
        answers.append((address, info))
        if not args.json:
            print(f"server {address}\n" + "\n".join(f"  {x}" for x in describe_info(info).splitlines()))
    if args.json and answers:
        plain = (_plain(answers[0][1]) if len(addresses) == 1
                 else [dict(_plain(info), server=address) for address, info in answers])
        print(json.dumps(plain, indent=2))
    return rc
