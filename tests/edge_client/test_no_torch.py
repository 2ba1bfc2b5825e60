"""The device side must install on a Raspberry Pi: neither it nor the shared layer (sled) imports torch or
transformers."""

import ast
import subprocess
import sys
from pathlib import Path

import edge_client
import sled

ROOTS = [Path(edge_client.__file__).parent, Path(sled.__file__).parent]
FORBIDDEN = {"torch", "transformers", "verify_server", "kernels", "bench", "sled_train"}


def _sources():
    return [(root, path) for root in ROOTS for path in root.rglob("*.py") if not path.name.endswith("_pb2_grpc.py")
            and not path.name.endswith("_pb2.py")]


def test_no_forbidden_import_statement():
    for _, path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"


def test_importing_everything_loads_no_torch():
    modules = [f"{root.name}.{p.relative_to(root).with_suffix('').as_posix().replace('/', '.')}"
               for root, p in _sources() if p.name != "__init__.py"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
            "assert not bad, bad\nprint(len(sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
