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
