"""The verify server process: grpc.aio, health (NOT_SERVING until warm), reflection, graceful shutdown."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sled.v1 import verify_pb2 as pb
from sled.v1 import verify_pb2_grpc as pb_grpc
from sled.v1.limits import max_message_bytes

from .config import ServerConfig
from .engine import Engine
from .model_loader import Target, load_target, resolve_device, resolve_dtype
from .servicer import ExceptionInterceptor, VerifierServicer
from .start_cache import StartCache

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Verifier"].full_name


class ServerLost(RuntimeError):
    """The server stopped because it could not verify any more (a tensor-parallel rank died)."""


class VerifyServer:
    """Owns the gRPC server and, once loaded, the engine. `target` may be given preloaded (tests share one)."""

    def __init__(self, config: ServerConfig, target: Target | None = None, attention: str = "sdpa"):
        self.config = config
        self.target = target
        self.attention = attention
        self.engine: Engine | None = None
        self.leader = None  # tensor_parallel.Leader where the target is split over ranks
        self.lost: str | None = None  # why the server cannot serve any more (a tensor-parallel rank died)
        self.on_lost = None  # called (from any thread) with that reason
        self.servicer = VerifierServicer(config)
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(
            interceptors=[ExceptionInterceptor()],
            # A message past what these settings allow is refused by gRPC before it is decoded.
            options=[("grpc.max_receive_message_length",
                      max_message_bytes(config.max_seq_len, config.max_draft_tokens, config.max_draft_top_k))],
        )
        pb_grpc.add_VerifierServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.port: int | None = None
        # Every torch call of the server (load, packing, warm-up, the step loop) runs on this one thread: each thread
        # that enters an OpenMP region keeps a pool of its own, and with more OpenMP threads than cores libgomp stops
        # spinning between regions, so every parallel op would wait for a sleeping worker.
        self._torch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sled-torch")

    async def _on_torch_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._torch, functools.partial(fn, *args))

    async def start(self) -> int:
        self._loop = asyncio.get_running_loop()
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        cfg = self.config
        address = f"{cfg.host}:{cfg.port}"
        try:
            if cfg.tls_cert is not None:  # the pair was checked with the config
                pair = (Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())
                client_ca = Path(cfg.tls_client_ca).read_bytes() if cfg.tls_client_ca is not None else None
                self.port = self.server.add_secure_port(address, grpc.ssl_server_credentials(
                    [pair], root_certificates=client_ca, require_client_auth=client_ca is not None))
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError as err:  # grpc raises where it once returned 0
            raise OSError(f"cannot listen on {address}: {err}") from None
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        await self.server.start()
        log.info("listening on %s:%d%s (NOT_SERVING until the model is warm)", cfg.host, self.port, cfg.tls_mode)
        return self.port

    async def load(self) -> None:
        cfg = self.config
        t0 = time.monotonic()
        if cfg.tensor_parallel > 1:
            engine = await self._on_torch_thread(self._sharded_engine)
        else:
            if self.target is None:
                device = resolve_device(cfg.device)
                self.target = await self._on_torch_thread(load_target, cfg.target, device,
                                                          resolve_dtype(cfg.dtype, device), cfg.tokenizer,
                                                          StartCache(cfg.start_cache_folder()))
            engine = await self._on_torch_thread(Engine, cfg, self.target, self.attention)
        await self._on_torch_thread(engine.warmup)
        engine.start(self._torch)
        self.engine = engine
        self.servicer.engine = engine
        if cfg.metrics_port:
            try:
                engine.metrics.serve(cfg.metrics_port, cfg.host)
            except OSError as err:  # the engine is stopped with the server (serve)
                raise OSError(f"cannot serve metrics on {cfg.host}:{cfg.metrics_port}: {err.strerror or err}") from None
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        kernels = engine.kernels()
        fused = (f"fused up to {kernels['fused_max_tokens']} tokens" if kernels["fused_max_tokens"] else "not fused")
        log.info("target %s warm in %.1fs (%s %s, %s attention, %s linear, %s): SERVING", self.target.name,
                 time.monotonic() - t0, kernels["device"], kernels["dtype"], kernels["attention"], kernels["linear"],
                 fused)

    def _sharded_engine(self) -> Engine:
        """Start the other ranks, build rank 0's shard of the target (loaded on the host, then cut, then moved) and
        the engine over it; the other ranks build theirs meanwhile."""
        from .tensor_parallel import Leader, rank_device, shard_model

        cfg = self.config
        loop = self._loop  # this runs on the torch thread; the reason is handled on the server's event loop
        self.leader = Leader(cfg, self.attention, on_lost=lambda why: loop.call_soon_threadsafe(self._lose, why))
        try:
            device = rank_device(resolve_device(cfg.device), 0)
            if self.target is None:  # rank 0's slices only, where the target is a safetensors folder
                self.target = load_target(cfg.target, torch.device("cpu"), resolve_dtype(cfg.dtype, device),
                                          cfg.tokenizer, StartCache(cfg.start_cache_folder()),
                                          shard=(0, cfg.tensor_parallel))
            else:
                shard_model(self.target.model, 0, cfg.tensor_parallel)
            self.target.model.to(device)
            engine = Engine(cfg, self.target, self.attention, self.leader)
            self.leader.ready()
        except BaseException:
            self.leader.stop()
            self.leader = None
            raise
        return engine

    def _lose(self, why: str) -> None:
        """The server cannot verify any more: NOT_SERVING at once, and whoever runs it is told."""
        self.lost = why
        for name in ("", SERVICE):
            asyncio.ensure_future(self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING))
        if self.on_lost is not None:
            self.on_lost(why)

    def reload_credentials(self) -> None:
        """Read auth_tokens_file again (SIGHUP): revoked devices are refused at their next Open."""
        if self.config.auth_tokens_file is None:
            log.info("SIGHUP: no auth_tokens_file to reload")
            return
        try:
            count = self.servicer.auth.reload()
        except ValueError as err:
            log.error("SIGHUP: %s; the device tokens read before stay in force", err)
            return
        log.info("SIGHUP: %d device tokens loaded from %s", count, self.config.auth_tokens_file)

    async def stop(self, grace: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        if self.engine is not None:
            self.engine.stop()
        if self.leader is not None:
            await self._on_torch_thread(self.leader.stop)
        self._torch.shutdown(wait=False)


async def serve(config: ServerConfig, attention: str = "sdpa") -> None:
    """Run until SIGTERM or SIGINT, then drain in-flight calls and stop."""
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    server = VerifyServer(config, attention=attention)
    stop = asyncio.Event()
    server.on_lost = lambda why: stop.set()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, server.reload_credentials)
    port = await server.start()
    loader = asyncio.create_task(server.load())
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({loader, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if loader in done:
        if loader.exception() is not None:  # a load failure ends the process with its error, the port closed first
            waiter.cancel()
            await server.stop(grace=0)
            loader.result()
        print(f"SLED verify server ready on {config.host}:{port}{config.tls_mode} "
              f"(target {server.target.name})", flush=True)
        await waiter
    else:
        loader.cancel()
    log.info("shutting down: NOT_SERVING, %gs for the sessions under way", config.drain_s)
    await server.stop(grace=0 if server.lost else config.drain_s)
    if server.lost:
        raise ServerLost(server.lost)
