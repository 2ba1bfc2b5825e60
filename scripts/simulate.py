"""make simulate: run docker-compose.yml's services as local processes on loopback, without a Docker engine.

The compose file is the single source: each service's `command` runs with the repository's .venv,
container paths from `volumes` map to the local folders, service names map to 127.0.0.1 and every
published port to a free local one. `depends_on: service_healthy` waits for the gRPC health check
(SERVING). Devices run their workload and print a JSON summary; this prints a table of them.
CPU and memory limits (`deploy.resources.limits`) are honoured by Docker only; here they are shown.
Bounded in time (--timeout); everything started is stopped on exit, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_compose(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text())  # merge keys (<<: *device) resolve here
    services = doc.get("services") or {}
    if not services:
        raise ValueError(f"{path} has no services")
    for name, svc in services.items():
        if not isinstance(svc.get("command"), list):
            raise ValueError(f"service {name}: command must be a list (exec form)")
    return services


class Plan:
    """How compose names, paths and ports become local ones."""

    def __init__(self, services: dict):
        self.services = services
        self.ports: dict[tuple[str, int], int] = {}
        for name, svc in services.items():
            for mapping in svc.get("ports", []):
                container = int(str(mapping).split(":")[-1])
                self.ports[(name, container)] = free_port()
            args = svc["command"]
            for flag in ("--port", "--metrics-port", "--http-port"):
                if flag in args:
                    container = int(args[args.index(flag) + 1])
                    self.ports.setdefault((name, container), free_port())
        self.mounts: list[tuple[str, Path]] = []
        for svc in services.values():
            for vol in svc.get("volumes", []):
                src, dst = str(vol).split(":")[:2]
                self.mounts.append((dst, (ROOT / src).resolve()))

    def rewrite(self, name: str, arg: str) -> str:
        for dst, src in self.mounts:
            if arg == dst or arg.startswith(dst + "/"):
                return str(src) + arg[len(dst):]
        host, _, port = arg.rpartition(":")
        if host in self.services and port.isdigit():
            return f"127.0.0.1:{self.ports[(host, int(port))]}"
        if arg == "0.0.0.0":
            return "127.0.0.1"  # loopback only
        return arg

    def command(self, name: str) -> list[str]:
        args = list(self.services[name]["command"])
        exe = BIN / args[0]
        out = [str(exe) if exe.exists() else args[0]]
        i = 1
        while i < len(args):
            arg = args[i]
            if arg in ("--port", "--metrics-port", "--http-port") and i + 1 < len(args):
                out += [arg, str(self.ports[(name, int(args[i + 1]))])]
                i += 2
                continue
            out.append(self.rewrite(name, arg))
            i += 1
        return out

    def grpc_port(self, name: str) -> int | None:
        args = self.services[name]["command"]
        return self.ports.get((name, int(args[args.index("--port") + 1]))) if "--port" in args else None


def healthy(port: int) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1).status
        return status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def pump(name: str, proc: subprocess.Popen, lines: list[str]) -> None:
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        print(f"{name:>14} | {line}", end="", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compose", default=str(ROOT / "docker-compose.yml"), help="compose file (default docker-compose.yml)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds before everything is stopped (default 900)")
    ap.add_argument("--json", metavar="FILE", help="write the device summaries as JSON")
    args = ap.parse_args()
    try:
        services = load_compose(Path(args.compose))
    except (OSError, ValueError) as err:
        print(f"simulate: {err}", file=sys.stderr)
        return 2
    plan = Plan(services)
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, list[str]] = {}
    deadline = time.monotonic() + args.timeout

    def start(name: str) -> None:
        limits = (services[name].get("deploy") or {}).get("resources", {}).get("limits", {})
        cmd = plan.command(name)
        print(f"[simulate] {name}: {' '.join(Path(c).name if c.startswith(str(BIN)) else c for c in cmd)}"
              + (f"  (limits in Docker: {limits})" if limits else ""), flush=True)
        procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        logs[name] = []
        threading.Thread(target=pump, args=(name, procs[name], logs[name]), daemon=True).start()

    def stop_all() -> None:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)

    try:
        pending = dict(services)
        started_healthy: set[str] = set()
        while pending:
            ready = [n for n, s in pending.items()
                     if all(d in started_healthy for d in (s.get("depends_on") or {}))]
            if not ready:
                raise RuntimeError(f"depends_on cannot be met for {sorted(pending)}")
            for name in ready:
                start(name)
                del pending[name]
            for name in ready:
                port = plan.grpc_port(name)
                if port is None:
                    started_healthy.add(name)
                    continue
                while not healthy(port):
                    if procs[name].poll() is not None:
                        raise RuntimeError(f"{name} exited with {procs[name].returncode}")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{name} not healthy before the timeout")
                    time.sleep(1)
                print(f"[simulate] {name} is healthy (SERVING)", flush=True)
                started_healthy.add(name)
        devices = [n for n in services if plan.grpc_port(n) is None]
        for name in devices:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the simulation ran past --timeout")
            procs[name].wait(timeout=remaining)
        time.sleep(0.2)
        summaries, failed = [], []
        for name in devices:
            summary = next((json.loads(l) for l in reversed(logs[name]) if l.startswith("{")), None)
            if procs[name].returncode != 0 or summary is None:
                failed.append(name)
            else:
                summaries.append(summary)
        print("\n| device | drafter | requests | tokens | tok/s | acceptance | reconnects | unverified |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for s in summaries:
            print(f"| {s['device']} | {s['drafter']} | {s['requests']} | {s['tokens']} | {s['tokens_per_s']:.1f} | "
                  f"{s['acceptance_rate']:.2f} | {s['reconnects']} | {s['unverified_tokens']} |")
        if args.json:
            Path(args.json).write_text(json.dumps(summaries, indent=2))
        if failed:
            print(f"[simulate] failed: {failed}", file=sys.stderr)
            return 1
        return 0
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired, KeyboardInterrupt) as err:
        print(f"[simulate] stopping: {err!r}", file=sys.stderr)
        return 1
    finally:
        stop_all()
        print("[simulate] all services stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
