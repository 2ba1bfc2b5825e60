"""Tensor parallelism over PyTorch distributed: the target's attention heads and MLP columns over N ranks.

Megatron's split (gpt-fast's tp.py is a compact model of it): q, k, v and gate, up are column-parallel (each rank
keeps its rows: whole heads, a slice of the MLP), o and down row-parallel (each rank keeps the matching input
columns), so each layer needs one all-reduce after o and one after down; the KV pool is sharded by KV head. Rank 0
is the server: it alone speaks gRPC, schedules, samples and answers; each step it broadcasts the step's input to the
other ranks (spawned by it, one process each, NCCL on CUDA, gloo on the CPU), and every rank runs its shard of the
forward. A rank that dies takes the server to NOT_SERVING with a log line that names it.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing as mp
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

log = logging.getLogger(__name__)

# A collective that waits this long for a rank has lost it: the step fails rather than hang.
COLLECTIVE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Shard:
    """This process's place in the group, and the all-reduce its row-parallel projections end with."""

    rank: int
    world: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def least(self, n: int, device: torch.device) -> int:
        """The smallest of every rank's n (each rank's pool must have the blocks the leader's tables name)."""
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def check_divisible(config, world: int) -> None:
    """The shape must split evenly: whole attention heads and KV heads per rank, equal MLP slices."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % world:
            raise ValueError(f"tensor_parallel {world} does not divide the target's {name} ({value}): choose a "
                             "divisor of it")


def _keep(module: nn.Linear, dim: int, rank: int, world: int) -> None:
    """Keep this rank's slice of a projection's weight along `dim` (0: output rows, 1: input columns)."""
    module.weight = nn.Parameter(module.weight.detach().chunk(world, dim)[rank].contiguous(), requires_grad=False)
    if module.bias is not None:
        if dim == 0:
            module.bias = nn.Parameter(module.bias.detach().chunk(world)[rank].contiguous(), requires_grad=False)
        elif rank:  # a row-parallel bias is added once, after the all-reduce: rank 0 keeps it
            module.bias = nn.Parameter(torch.zeros_like(module.bias), requires_grad=False)


def shard_model(model: nn.Module, rank: int, world: int) -> None:
    """Cut the model's projections down to rank's shard, in place."""
    check_divisible(model.config, world)
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for column in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj):
            _keep(column, 0, rank, world)
        for row in (a.o_proj, m.down_proj):
            _keep(row, 1, rank, world)


COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # kept by output rows
ROW = ("o_proj", "down_proj")  # kept by input columns


def load_shard(folder: Path, config, dtype: torch.dtype, rank: int, world: int) -> nn.Module:
    """The model of a Hugging Face folder with only rank's slices of its projections read from the safetensors
    files (the rest whole): a rank holds its shard and never the whole checkpoint, as shard_model would leave it."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    check_divisible(config, world)
    where = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            where.update({name: file for name in f.keys()})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    shard_model(model, rank, world)  # the shard's shapes, nothing allocated
    model.to_empty(device="cpu")
    model.requires_grad_(False)
    for name, param in model.named_parameters():
        if name not in where:
            if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
                continue  # tied below
            raise ValueError(f"{folder} has no weight {name}")
        # one tensor's mapping open at a time: the pages a slice touches are let go with it
        with safe_open(str(where[name]), "pt") as f:
            part = f.get_slice(name)
            module = name.rsplit(".", 2)[-2]
            shape = part.get_shape()
            if module in COLUMN:
                n = shape[0] // world
                value = part[rank * n:(rank + 1) * n]
            elif module in ROW and name.endswith(".weight"):
                n = shape[1] // world
                value = part[:, rank * n:(rank + 1) * n]
            elif module in ROW and rank:  # a row-parallel bias is added once, after the all-reduce
                value = torch.zeros(param.shape)
            else:
                value = part[:]
            param.copy_(value.to(dtype))
            del value
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    for module in model.modules():  # RoPE tables were not materialized: rebuilt (the runner keeps its own)
        if hasattr(module, "rope_init_fn") and hasattr(module, "inv_freq"):
            inv_freq, _ = module.rope_init_fn(module.config, torch.device("cpu"))
            module.inv_freq = inv_freq
            module.original_inv_freq = inv_freq
    return model.eval()


def init_group(rank: int, world: int, port: int, device: torch.device) -> Shard:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return Shard(rank, world)


def _broadcast(message=None):
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def worker_main(rank: int, world: int, port: int, config, attention: str) -> None:
    """A rank other than 0: build its shard, then run every command rank 0 broadcasts until told to stop."""
    from .engine import build_compute
    from .model_loader import load_target, resolve_device, resolve_dtype
    from .start_cache import StartCache

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank {rank}: %(message)s")
    device = rank_device(resolve_device(config.device), rank)
    if device.type == "cpu":
        torch.set_num_threads(config.threads or max(1, (os.cpu_count() or 1) // world))
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    shard = init_group(rank, world, port, device)
    try:
        target = load_target(config.target, torch.device("cpu"), resolve_dtype(config.dtype, device), config.tokenizer,
                             StartCache(config.start_cache_folder()), shard=(rank, world))
        target.model.to(device)
        _, runner = build_compute(config, target, attention, shard)
        ops = {"forward": runner.forward}
        _broadcast()  # this rank is ready
        while True:
            command = _broadcast()
            if command is None:
                break
            name, args = command
            ops[name](*args)
    except Exception:  # noqa: BLE001 - this rank's end; rank 0 sees it gone and says so
        log.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class Leader:
    """Rank 0's side: starts the other ranks, mirrors each shard-touching call to them, stops them."""

    def __init__(self, config, attention: str, on_lost: Callable[[str], None] | None = None):
        self.world = config.tensor_parallel
        self.on_lost = on_lost
        self._stopping = threading.Event()
        self._ready = False
        with socket.socket() as s:  # a free loopback port for the group's rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        context = mp.get_context("spawn")
        self.procs = [context.Process(target=worker_main, args=(rank, self.world, port, config, attention),
                                      name=f"sled-tp-rank-{rank}", daemon=True)
                      for rank in range(1, self.world)]
        for proc in self.procs:
            proc.start()
        from .model_loader import resolve_device

        device = rank_device(resolve_device(config.device), 0)
        if device.type == "cpu":
            torch.set_num_threads(config.threads or max(1, (os.cpu_count() or 1) // self.world))
        elif device.type == "cuda":
            torch.cuda.set_device(device)
        self.shard = init_group(0, self.world, port, device)
        threading.Thread(target=self._watch, name="sled-tp-watch", daemon=True).start()

    def ready(self) -> None:
        """Wait for every rank to have built its shard (rank 0's own is built by then)."""
        _broadcast()
        self._ready = True
        log.info("tensor parallel: %d ranks ready (%s)", self.world, dist.get_backend())

    def _watch(self) -> None:
        while not self._stopping.wait(0.5):
            for rank, proc in enumerate(self.procs, start=1):
                if not proc.is_alive():
                    why = (f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}: the "
                           "target's shards are incomplete, the server cannot verify; NOT_SERVING")
                    log.error(why)
                    self._stopping.set()
                    if self.on_lost is not None:
                        self.on_lost(why)
                    return

    def mirror(self, name: str, fn: Callable) -> Callable:
        """`fn` (rank 0's own) run on every rank: the call is broadcast first."""
        def call(*args):
            _broadcast((name, args))
            return fn(*args)
        return call

    def stop(self) -> None:
        """End every rank: told to where all are ready and alive, killed where not."""
        if not self._ready or (self._stopping.is_set() and not all(p.is_alive() for p in self.procs)):
            self._stopping.set()
            for proc in self.procs:
                proc.kill()
        else:
            self._stopping.set()
            try:
                _broadcast(None)
            except Exception:  # noqa: BLE001 - a rank already gone: it is killed below
                pass
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if dist.is_initialized():
            dist.destroy_process_group()
