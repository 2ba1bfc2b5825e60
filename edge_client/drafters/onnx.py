"""ONNX Runtime drafter: a model of scripts/export_onnx_draft.py or sled-train imitation, KV cache as arrays, rolled
back by length."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .base import DrafterOptions
from .kv_drafter import KVDrafter


class OnnxDrafter(KVDrafter):
    name = "onnx"

    def __init__(self, options: DrafterOptions):
        import onnxruntime as ort

        if not options.onnx_model:
            raise ValueError(f"the {self.name} drafter needs --onnx-model PATH (made by "
                             f"{'sled-train parallel' if self.name == 'parallel' else 'scripts/export_onnx_draft.py'})")
        path = Path(options.onnx_model)
        if not path.is_file():
            raise FileNotFoundError(f"ONNX draft model {path} "
                                    f"{'is a folder, not an .onnx file' if path.is_dir() else 'does not exist'}")
        meta_path = path.with_suffix(".json")
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path} (written beside the model by the export script) is missing")
        self.meta = json.loads(meta_path.read_text())
        parallel = self.meta.get("kind") == "parallel"
        if parallel != (self.name == "parallel"):
            raise ValueError(f"{path} is {'a parallel' if parallel else 'an autoregressive'} draft model: use "
                             f"--drafter {'parallel' if parallel else 'onnx'}")
        so = ort.SessionOptions()
        if options.threads:
            so.intra_op_num_threads = options.threads
        so.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        m = self.meta
        shape = (m["num_layers"], 1, m["num_kv_heads"], 0, m["head_dim"])
        self._empty = np.zeros(shape, dtype=np.float32)
        self._keys = self._empty
        self._values = self._empty
        super().__init__(options, int(m["eos_token_id"]), min(options.context_size, int(m["max_positions"])))

    def _eval(self, tokens: list[int]) -> np.ndarray:
        return self._eval_rows(tokens)[-1]

    def _eval_rows(self, tokens: list[int]) -> np.ndarray:
        logits, self._keys, self._values = self.session.run(
            ["logits", "present_keys", "present_values"],
            {"input_ids": np.asarray([tokens], dtype=np.int64), "past_keys": self._keys, "past_values": self._values},
        )
        return logits[0]

    def _truncate(self, length: int) -> None:
        self._keys = self._keys[:, :, :, :length]
        self._values = self._values[:, :, :, :length]
