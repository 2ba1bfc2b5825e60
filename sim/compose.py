"""make simulate: docker-compose.yml's services as local processes on loopback, without a Docker engine.

The compose file is the single source: each service's `command` runs with the repository's .venv,
container paths from `volumes` map to the local folders, service names map to 127.0.0.1 and every
published port to a free local one. `depends_on: service_healthy` waits for the gRPC health check
(SERVING). Devices run their workload and print a JSON summary; this prints a table of them.
CPU and memory limits (`deploy.resources.limits`) are honoured by Docker only; here they are shown.
Bounded in time (--timeout); everything started is stopped on exit, also on Ctrl-C.

Network realism: `--link delay_ms=20,jitter_ms=5,rate_mbit=50` gives each device its own emulated
link to the server (a user-space relay: delay and jitter each way, bandwidth cap). With `--netns`
(root), each device also runs in its own network namespace, joined to this one by a veth pair, and
reaches the server only through its link; `tc netem` shapes the veth when the kernel has it, else
the relay does. Only namespaces and links this run created are touched, and all are removed on exit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from sled.settings import yaml_error

from .linkemu import LinkEmulator, LinkSpec
from .processes import free_ports

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def load_compose(path: Path, profiles: tuple[str, ...] = ()) -> dict:
    """The compose file's services that run with `profiles` active: those without profiles, and those of one of them
    (compose's own rule)."""
    try:
        doc = yaml.safe_load(path.read_text())  # merge keys (<<: *device) resolve here
    except yaml.YAMLError as err:
        raise ValueError(yaml_error(path, err)) from None
    services = doc.get("services") if isinstance(doc, dict) else None
    if not services:
        raise ValueError(f"{path} has no services")
    if not isinstance(services, dict):
        raise ValueError(f"{path}: services must be a mapping of names to services, got {type(services).__name__}")
    for name, svc in services.items():
        if not isinstance(svc, dict):
            raise ValueError(f"service {name}: must be a mapping of settings, got {type(svc).__name__}")
        if not isinstance(svc.get("command"), list):
            raise ValueError(f"service {name}: command must be a list (exec form)")
    known = {p for svc in services.values() for p in svc.get("profiles") or ()}
    unknown = sorted(set(profiles) - known)
    if unknown:
        raise ValueError(f"{path} has no profile {', '.join(unknown)} (profiles: {', '.join(sorted(known)) or 'none'})")
    return {name: svc for name, svc in services.items()
            if not svc.get("profiles") or set(svc["profiles"]) & set(profiles)}


class Plan:
    """How compose names, paths and ports become local ones."""

    def __init__(self, services: dict):
        self.services = services
        wanted: list[tuple[str, int]] = []  # (service, container port), each once
        for name, svc in services.items():
            for mapping in svc.get("ports", []):
                wanted.append((name, int(str(mapping).split(":")[-1])))
            args = svc["command"]
            for flag in ("--port", "--metrics-port", "--http-port"):
                if flag in args:
                    wanted.append((name, int(args[args.index(flag) + 1])))
        wanted = list(dict.fromkeys(wanted))
        self.ports: dict[tuple[str, int], int] = dict(zip(wanted, free_ports(len(wanted))))
        self.mounts: list[tuple[str, Path]] = []
        for svc in services.values():
            for vol in svc.get("volumes", []):
                src, dst = str(vol).split(":")[:2]
                self.mounts.append((dst, (ROOT / src).resolve()))

    def rewrite(self, name: str, arg: str, via: dict | None = None) -> str:
        if "," in arg and all(self.rewrite(name, part, via) != part for part in arg.split(",")):
            return ",".join(self.rewrite(name, part, via) for part in arg.split(","))  # a device's list of servers
        for dst, src in self.mounts:
            if arg == dst or arg.startswith(dst + "/"):
                return str(src) + arg[len(dst):]
        host, _, port = arg.rpartition(":")
        if host in self.services and port.isdigit():
            if via and host in via:
                return via[host]  # through this device's emulated link
            return f"127.0.0.1:{self.ports[(host, int(port))]}"
        if arg == "0.0.0.0":
            return "127.0.0.1"  # loopback only
        return arg

    def command(self, name: str, via: dict | None = None) -> list[str]:
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
            out.append(self.rewrite(name, arg, via))
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


class Namespaces:
    """Per-device network namespaces joined to this one by veth pairs; removed on exit."""

    def __init__(self, tag: str):
        self.tag = tag
        self.created: list[str] = []
        self.netem = None

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def add(self, index: int, spec: LinkSpec) -> tuple[str, str, str]:
        """Returns (namespace, host-side address, device-side address)."""
        ns = f"sled-{self.tag}-{index}"
        host_if, dev_if = f"sh{self.tag}{index}"[:15], f"sd{self.tag}{index}"[:15]
        host_ip, dev_ip = f"10.77.{index}.1", f"10.77.{index}.2"
        self._ip("netns", "add", ns)
        self.created.append(ns)
        self._ip("link", "add", host_if, "type", "veth", "peer", "name", dev_if)
        self._ip("link", "set", dev_if, "netns", ns)
        self._ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        self._ip("link", "set", host_if, "up")
        self._ip("netns", "exec", ns, "ip", "addr", "add", f"{dev_ip}/30", "dev", dev_if)
        self._ip("netns", "exec", ns, "ip", "link", "set", dev_if, "up")
        self._ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        netem = ["netem", "delay", f"{spec.delay_ms}ms", f"{spec.jitter_ms}ms"]
        if spec.rate_mbit:
            netem += ["rate", f"{spec.rate_mbit}mbit"]
        if spec.delay_ms or spec.jitter_ms or spec.rate_mbit:
            done = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev_if, "root", *netem],
                                  capture_output=True, text=True)
            ok = done.returncode == 0 and subprocess.run(["tc", "qdisc", "add", "dev", host_if, "root", *netem],
                                                         capture_output=True, text=True).returncode == 0
            self.netem = ok if self.netem is None else (self.netem and ok)
        return ns, host_ip, dev_ip

    def remove(self) -> None:
        for ns in self.created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # its veth pair goes with it
        self.created.clear()


def pump(name: str, proc: subprocess.Popen, lines: list[str]) -> None:
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        print(f"{name:>14} | {line}", end="", flush=True)


def hold_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


_stop: list[str] = []  # the signal that asked the run to stop (set by `interrupted`, read by `pause`)


def interrupted(signum: int, _frame) -> None:
    """Ctrl-C or SIGTERM: ask the run to stop, once; further signals are ignored until everything is cleaned up.
    It only records the signal. An exception raised here lands in whatever the main thread runs at that moment, an
    object's __del__ included (a gRPC channel's, freed after a health check), where Python prints and drops it:
    the run then waited on, deaf to the signals it had just turned off. `pause` raises it in the run's own code."""
    hold_signals()
    _stop.append(signal.Signals(signum).name)


def pause(seconds: float) -> None:
    """Sleep up to `seconds`; KeyboardInterrupt once a signal has asked the run to stop (checked every 0.1 s)."""
    end = time.monotonic() + seconds
    while True:
        if _stop:
            raise KeyboardInterrupt(_stop[0])
        left = end - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(0.1, left))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compose", default=str(ROOT / "docker-compose.yml"), help="compose file (default docker-compose.yml)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds before everything is stopped (default 900)")
    ap.add_argument("--json", metavar="FILE", help="write the device summaries as JSON")
    ap.add_argument("--link", metavar="SPEC", help="emulated link per device, e.g. delay_ms=20,jitter_ms=5,rate_mbit=50")
    ap.add_argument("--netns", action="store_true", help="run each device in its own network namespace (root)")
    ap.add_argument("--profile", action="append", default=[], metavar="NAME",
                    help="also run the services of this compose profile (e.g. fleet: a second server and devices "
                         "that take both); repeatable")
    args = ap.parse_args()
    if not args.timeout > 0:
        ap.error(f"--timeout must be positive, got {args.timeout:g}")
    try:
        spec = LinkSpec.parse(args.link) if args.link else None
    except ValueError as err:
        print(f"simulate: {err}", file=sys.stderr)
        return 2
    if args.netns and os.geteuid() != 0:
        print("simulate: --netns needs root (network namespaces and veth pairs)", file=sys.stderr)
        return 2
    try:
        services = load_compose(Path(args.compose), tuple(args.profile))
    except (OSError, ValueError) as err:
        print(f"simulate: {err}", file=sys.stderr)
        return 2
    plan = Plan(services)
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, list[str]] = {}
    deadline = time.monotonic() + args.timeout
    links: list[LinkEmulator] = []
    namespaces = Namespaces(str(os.getpid() % 10000))
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)

    def route(name: str) -> tuple[dict | None, list[str]]:
        """For a device: the addresses of its upstream services through its link, and a command prefix."""
        deps = [d for d in (services[name].get("depends_on") or {}) if plan.grpc_port(d)]
        if not deps or not (spec or args.netns):
            return None, []
        index = len(links) + 1
        prefix, listen_host = [], "127.0.0.1"
        relay_spec = spec or LinkSpec()
        if args.netns:
            ns, host_ip, _ = namespaces.add(index, relay_spec)
            prefix, listen_host = ["ip", "netns", "exec", ns], host_ip
            if namespaces.netem:
                relay_spec = LinkSpec()  # the kernel shapes the veth; the relay only forwards
        via = {}
        for dep in deps:
            link = LinkEmulator(relay_spec, "127.0.0.1", plan.grpc_port(dep), listen_host, seed=index)
            links.append(link)
            via[dep] = f"{listen_host}:{link.port}"
        print(f"[simulate] {name}: link {relay_spec if relay_spec != LinkSpec() else spec} via {via}"
              + (f" in namespace {prefix[-1]} (netem {'on' if namespaces.netem else 'unavailable: user-space relay'})"
                 if prefix else ""), flush=True)
        return via, prefix

    def start(name: str) -> None:
        limits = (services[name].get("deploy") or {}).get("resources", {}).get("limits", {})
        via, prefix = route(name)
        cmd = prefix + plan.command(name, via)
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
                    pause(1)
                print(f"[simulate] {name} is healthy (SERVING)", flush=True)
                started_healthy.add(name)
        devices = [n for n in services if plan.grpc_port(n) is None]
        for name in devices:
            while procs[name].poll() is None:
                if time.monotonic() > deadline:
                    raise TimeoutError("the simulation ran past --timeout")
                pause(0.2)
        pause(0.2)
        summaries, failed = [], []
        for name in devices:
            summary = next((json.loads(l) for l in reversed(logs[name]) if l.startswith("{")), None)
            if procs[name].returncode != 0 or summary is None:
                failed.append(name)
            else:
                summaries.append(summary)
        if links:
            print(f"[simulate] emulated links carried {sum(l.bytes for l in links) / 1e6:.2f} MB", flush=True)
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
    except (RuntimeError, TimeoutError, KeyboardInterrupt) as err:
        print(f"[simulate] stopping: {err!r}", file=sys.stderr)
        return 1
    finally:
        hold_signals()  # a second Ctrl-C or SIGTERM must not cut the clean-up short
        stop_all()
        for link in links:
            link.close()
        namespaces.remove()
        print("[simulate] all services stopped" + (", namespaces removed" if args.netns else ""), flush=True)


if __name__ == "__main__":
    sys.exit(main())
