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


def fill(folder):
    (folder / "weights.bin").write_bytes(bytes(range(256)) * 64)
    (folder / "sub").mkdir()
    (folder / "sub" / "vocab.txt").write_text("a\nb\n")


def test_a_folder_entry_is_kept_whole_and_a_changed_or_missing_file_is_not_trusted(tmp_path, caplog):
    cache = StartCache(tmp_path / "start")
    assert cache.get_folder("target", KEY) is None
    cache.put_folder("target", KEY, fill)
    folder = cache.get_folder("target", KEY)
    assert (folder / "sub" / "vocab.txt").read_text() == "a\nb\n"
    assert cache.get_folder("target", {**KEY, "dtype": "bf16"}) is None  # another key: not this folder
    caplog.set_level(logging.WARNING, logger="verify_server.start_cache")
    weights = folder / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[100] ^= 1  # one bit flipped
    weights.write_bytes(bytes(data))
    assert cache.get_folder("target", KEY) is None and "weights.bin does not match" in caplog.text
    cache.put_folder("target", KEY, fill)  # converted again, in place
    assert cache.get_folder("target", KEY) == folder
    (folder / "sub" / "vocab.txt").unlink()
    assert cache.get_folder("target", KEY) is None
    assert not [p for p in (tmp_path / "start").iterdir() if p.name.endswith(".tmp")]  # no half-written folder


def test_a_failed_conversion_keeps_nothing(tmp_path):
    cache = StartCache(tmp_path)

    def broken(folder):
        (folder / "part").write_text("half")
        raise OSError("disk full")

    cache.put_folder("target", KEY, broken)
    assert cache.get_folder("target", KEY) is None and list(tmp_path.iterdir()) == []


def test_a_ggufs_key_follows_the_file_and_the_dtype(tmp_path):
    import os

    import torch

    from verify_server.model_loader import gguf_key

    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    key = gguf_key(path, torch.float32)
    assert gguf_key(path, torch.float32) == key
    assert gguf_key(path, torch.bfloat16) != key
    os.utime(path, ns=(1, 1))  # replaced by another file of the same size
    assert gguf_key(path, torch.float32) != key
    json.dumps(key)  # a key is plain JSON: it compares equal after a round trip


def test_a_ggufs_first_load_parses_it_once_and_leaves_the_gguf_package_as_it_was(monkeypatch, tmp_path):
    """transformers reads a GGUF three times (config, tokenizer, weights) and builds gguf's name map once for each
    module; inside one_gguf_read each file is parsed once and each map built once, and afterwards the package is
    as it was, an error inside included."""
    import gguf
    import pytest

    from verify_server.model_loader import one_gguf_read

    parsed, built = [], []

    def reader(path, mode="r"):
        parsed.append((path, mode))
        return object()

    def name_map(arch, n_blocks):
        built.append((arch, n_blocks))
        return object()

    monkeypatch.setattr(gguf, "GGUFReader", reader)
    monkeypatch.setattr(gguf, "get_tensor_name_map", name_map)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    with one_gguf_read():
        first = gguf.GGUFReader(str(a))
        assert gguf.GGUFReader(a) is first and gguf.GGUFReader(str(tmp_path / "." / "a.gguf")) is first
        assert gguf.GGUFReader(str(b)) is not first
        assert gguf.get_tensor_name_map(1, 30) is gguf.get_tensor_name_map(1, 30)
        assert gguf.get_tensor_name_map(1, 31) is not gguf.get_tensor_name_map(1, 30)
    assert len(parsed) == 2 and built == [(1, 30), (1, 31)]
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is name_map
    with pytest.raises(RuntimeError), one_gguf_read():
        raise RuntimeError("a failed load")
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is name_map
    with one_gguf_read():  # a new block parses again
        gguf.GGUFReader(str(a))
    assert len(parsed) == 3
