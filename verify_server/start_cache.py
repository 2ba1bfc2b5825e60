"""What the server measures or converts at start, kept on disk so that a restart is ready in seconds.

An entry is one JSON file named after what it holds and a hash of its key: what the measurement depends on
(machine, target, dtype, threads, kernel build). The file repeats the key and carries a checksum of its body, so an
entry that was edited, cut short or written for another key is measured again and rewritten, never trusted. A
folder entry (a GGUF target converted once) is a folder beside its JSON file, which records every file's size and
CRC-32.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

FORMAT = 2  # bumped when an entry's layout changes: older entries are then stale


def file_digest(path: Path) -> str:
    """A kept file's size and CRC-32: what catches a truncated or damaged file, at memory speed (a warm start reads
    the target's weights through it; SHA-256 took seconds longer)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return f"{size}:{crc:08x}"


def _digest(data) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class StartCache:
    """Entries under `folder`; None: nothing is kept (every start measures)."""

    def __init__(self, folder: str | Path | None):
        self.folder = Path(folder) if folder is not None else None

    def path(self, name: str, key: dict) -> Path | None:
        if self.folder is None:
            return None
        return self.folder / f"{name}-{_digest({'format': FORMAT, 'key': key})[:16]}.json"

    def get(self, name: str, key: dict) -> dict | None:
        """The value stored for `key`; None where there is none, or the entry is corrupt or stale (logged)."""
        path = self.path(name, key)
        if path is None or not path.exists():
            return None
        try:
            entry = json.loads(path.read_text())
            body = {"format": entry["format"], "key": entry["key"], "value": entry["value"]}
            intact = entry["sha256"] == _digest(body)
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("start cache %s is corrupt (%s): measuring again", path, err)
            return None
        if not intact:
            log.warning("start cache %s is corrupt (its checksum does not match): measuring again", path)
            return None
        if body["format"] != FORMAT or body["key"] != key:
            log.warning("start cache %s is stale (written for another %s): measuring again", path,
                        "format" if body["format"] != FORMAT else "key")
            return None
        return body["value"]

    def put(self, name: str, key: dict, value: dict) -> None:
        """Store `value` for `key`, atomically; a folder that cannot be written is logged, not raised."""
        path = self.path(name, key)
        if path is None:
            return
        body = {"format": FORMAT, "key": key, "value": value}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
                json.dump({**body, "sha256": _digest(body)}, tmp, sort_keys=True, indent=1)
            os.replace(tmp.name, path)
        except OSError as err:
            log.warning("cannot keep the start cache in %s (%s): the next start measures again", path.parent, err)

    def get_folder(self, name: str, key: dict) -> Path | None:
        """The folder kept for `key`, every file as its entry recorded it; None where there is none, or the entry or
        any file is corrupt or stale (logged)."""
        value = self.get(name, key)
        if value is None:
            return None
        folder = self.path(name, key).with_suffix("")
        try:
            files = value["files"]
            bad = [rel for rel, digest in files.items() if file_digest(folder / rel) != digest]
        except (OSError, KeyError, TypeError, AttributeError) as err:
            bad = [str(err)]
        if bad:
            log.warning("start cache %s is corrupt (%s does not match its checksum): converting again", folder,
                        bad[0])
            return None
        return folder

    def put_folder(self, name: str, key: dict, write: Callable[[Path], None]) -> None:
        """Keep the folder `write(folder)` fills for `key`, with every file's checksum; a failure is logged."""
        path = self.path(name, key)
        if path is None:
            return
        folder = path.with_suffix("")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=path.parent, suffix=".tmp"))
            try:
                write(tmp)
                files = {str(f.relative_to(tmp)): file_digest(f) for f in sorted(tmp.rglob("*")) if f.is_file()}
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(tmp, folder)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        except Exception as err:  # noqa: BLE001 - a conversion that cannot be kept must not fail the start
            log.warning("cannot keep the start cache in %s (%s): the next start converts again", path.parent, err)
            return
        self.put(name, key, {"files": files})
