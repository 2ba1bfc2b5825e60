import json
import logging

from verify_server.start_cache import StartCache

KEY = {"machine": "x86_64 test cpu", "target": "t", "dtype": "torch.float32", "threads": 2, "fused_build": "b1"}


def test_an_entry_is_read_back_under_its_own_key_only(tmp_path):
    cache = StartCache(tmp_path)
    assert cache.get("fused", KEY) is None  # nothing kept yet
    cache.put("fused", KEY, {"fused_max_tokens": 48})
    assert cache.get("fused", KEY) == {"fused_max_tokens": 48}
    for part, other in (("machine", "aarch64 other"), ("threads", 4), ("fused_build", "b2"), ("dtype", "bf16")):
        assert cache.get("fused", {**KEY, part: other}) is None  # each part of the key matters
    assert cache.get("other", KEY) is None


def test_a_corrupt_entry_is_not_trusted(tmp_path, caplog):
    cache = StartCache(tmp_path)
    cache.put("fused", KEY, {"fused_max_tokens": 48})
    path = cache.path("fused", KEY)
    caplog.set_level(logging.WARNING, logger="verify_server.start_cache")
    entry = json.loads(path.read_text())
    entry["value"]["fused_max_tokens"] = 480  # edited by hand: the checksum no longer matches
    path.write_text(json.dumps(entry))
    assert cache.get("fused", KEY) is None and "checksum" in caplog.text
    for garbage in ("", "{not json", json.dumps({"value": 1}), "[1, 2]"):
        caplog.clear()
        path.write_text(garbage)
        assert cache.get("fused", KEY) is None and "corrupt" in caplog.text
    cache.put("fused", KEY, {"fused_max_tokens": 32})  # rebuilt in place
    assert cache.get("fused", KEY) == {"fused_max_tokens": 32}


def test_an_entry_written_for_another_key_is_stale(tmp_path, caplog):
    cache = StartCache(tmp_path)
    cache.put("fused", {**KEY, "threads": 8}, {"fused_max_tokens": 96})
    # the file for KEY holds another key's entry, intact (copied from another host, say)
    cache.path("fused", {**KEY, "threads": 8}).rename(cache.path("fused", KEY))
    caplog.set_level(logging.WARNING, logger="verify_server.start_cache")
    assert cache.get("fused", KEY) is None and "stale" in caplog.text


def test_no_folder_keeps_nothing_and_an_unwritable_one_is_logged(tmp_path, caplog):
    off = StartCache(None)
    off.put("fused", KEY, {"fused_max_tokens": 48})
    assert off.get("fused", KEY) is None
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    caplog.set_level(logging.WARNING, logger="verify_server.start_cache")
    StartCache(blocked / "start").put("fused", KEY, {"fused_max_tokens": 48})
    assert "cannot keep the start cache" in caplog.text
