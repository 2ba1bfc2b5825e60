"""`sled-edge info --json` turns the server's Info into plain JSON: every field, lists for repeated fields,
numbers for 64-bit counters, nested messages as dicts (also repeated ones)."""

import json

from google.protobuf import descriptor_pb2

from edge_client.info import _plain
from sled.v1 import verify_pb2


def test_server_info_becomes_plain_json():
    info = verify_pb2.ServerInfo(target_name="t", vocab_size=49152, eos_token_ids=[2, 0])
    info.stats.steps = 2**40 + 3
    out = _plain(info)
    assert out["eos_token_ids"] == [2, 0]
    assert out["stats"]["steps"] == 2**40 + 3 and isinstance(out["stats"]["steps"], int)
    assert out["target_name"] == "t" and out["fused_max_tokens"] == 0  # unset fields are present too
    assert set(out) == {f.name for f in info.DESCRIPTOR.fields}
    assert json.loads(json.dumps(out)) == out


def test_repeated_messages_become_lists_of_dicts():
    # ServerInfo has no repeated message field; a descriptor proto has several.
    msg = descriptor_pb2.FileDescriptorProto(name="x.proto", dependency=["a.proto"])
    msg.message_type.add(name="A").field.add(name="f", number=1)
    out = _plain(msg)
    assert out["dependency"] == ["a.proto"]
    assert out["message_type"][0]["name"] == "A"
    assert out["message_type"][0]["field"][0]["number"] == 1
    assert out["enum_type"] == []


def test_info_for_people_shows_the_kv_pool_and_an_older_server_s_info_does_not():
    from edge_client.info import describe_info

    info = verify_pb2.ServerInfo(target_name="t", vocab_size=49152, max_sessions=256)
    info.stats.active_sessions, info.stats.free_slots = 64, 192
    assert "KV pool" not in describe_info(info)  # a server older than the paged pool sends no blocks
    info.stats.kv_block_size, info.stats.kv_blocks_total, info.stats.kv_blocks_used = 16, 4096, 96
    info.stats.kv_blocks_free, info.stats.kv_blocks_shared, info.stats.kv_blocks_cached = 4000, 32, 40
    text = describe_info(info)
    assert "256 sessions (64 open, 192 more may open)" in text
    assert ("KV pool: 4096 blocks of 16 tokens: 96 used, 4000 free, 32 shared by several sessions, 40 holding a "
            "cached prefix") in text
