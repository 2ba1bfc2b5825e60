"""What the server measures at start, kept on disk so that a restart is ready in seconds.

An entry is one JSON file named after what it holds and a hash of its key: what the measurement depends on
(machine, target, dtype, threads, kernel build). The file repeats the key and carries a checksum of its body, so an
entry that was edited, cut short or written for another key is measured again and rewritten, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

FORMAT = 1  # bumped when an entry's layout changes: older entries are then stale


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
