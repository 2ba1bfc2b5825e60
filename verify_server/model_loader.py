"""Loading the target model (GGUF file or Hugging Face folder) and its tokenizer facts."""

from __future__ import annotations

import json
import logging
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from sled.models import default_model_path
from sled.v1.fingerprint import vocab_fingerprint

from .start_cache import StartCache

log = logging.getLogger(__name__)

RANDOM_PREFIX = "random:"

# Llama shapes for random-weight targets (GPU capacity runs, where no checkpoint can travel). The vocabulary
# is always the default GGUF's (49,152 tokens), so the devices' drafters and tokenizer stay as they are.
TARGET_SHAPES: dict[str, dict] = {
    # Llama 3.2 1B
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_theta=500000.0),
    # Llama 3.1 8B
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, rope_theta=500000.0),
    # a few MiB, for tests of the random-target path itself
    "llama-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rope_theta=10000.0),
}


def random_target_shape(spec: str) -> dict:
    """The config fields of `random:NAME` (a name in TARGET_SHAPES) or `random:FILE.json` (config fields; a
    model_type field picks another supported family than Llama, and "stabilize": false leaves the weights as
    initialised)."""
    name = spec[len(RANDOM_PREFIX):] if spec.startswith(RANDOM_PREFIX) else spec
    if name in TARGET_SHAPES:
        return dict(TARGET_SHAPES[name])
    if name.endswith(".json"):
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"random target config {path} does not exist")
        fields = json.loads(path.read_text())
        if not isinstance(fields, dict):
            raise ValueError(f"{path}: expected a JSON object of model config fields")
        return fields
    raise ValueError(f"random target must be random:NAME ({', '.join(TARGET_SHAPES)}) or random:FILE.json, "
                     f"got {spec!r}")


@dataclass
class Target:
    model: torch.nn.Module  # a transformers causal LM of a supported family (model_runner.SUPPORTED_ARCHITECTURES)
    name: str
    vocab_tokens: list[str]
    eos_token_ids: tuple[int, ...]
    fingerprint: str
    tokenizer: object = None  # its transformers tokenizer: what constraints compile for

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {device!r} asked for, but {why} (torch {torch.__version__}); use cpu or auto")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} asked for, but only {torch.cuda.device_count()} CUDA GPU(s) are "
                             "visible")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def vocab_tokens(tokenizer, size: int | None = None) -> list[str]:
    """The token strings of ids 0..size-1 (the tokenizer's length by default), "" where an id has none: what the
    vocabulary fingerprint is computed over on both sides."""
    ids = list(range(len(tokenizer) if size is None else size))
    return [t if t is not None else "" for t in tokenizer.convert_ids_to_tokens(ids)]


def vocabulary_tokenizer(folder: str | Path | None = None):
    """The transformers tokenizer of a random target's vocabulary: from a tokenizer folder, else the default GGUF's."""
    from transformers import AutoTokenizer

    if folder is not None:
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"tokenizer folder {folder} does not exist")
        return AutoTokenizer.from_pretrained(str(folder))
    gguf = default_model_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


_ONE_READ = threading.Lock()


@contextmanager
def one_gguf_read():
    """Within the block, each GGUF file is parsed once and each architecture's tensor names are built once:
    transformers builds a gguf.GGUFReader for the config, the tokenizer and the weights alike (walking the
    vocabulary's every string takes seconds each), and a name map for each of the model's modules."""
    import functools

    import gguf

    with _ONE_READ:
        made, name_map, readers = gguf.GGUFReader, gguf.get_tensor_name_map, {}

        def shared(path, mode="r"):
            key = (str(Path(path).resolve()), mode)
            if key not in readers:
                readers[key] = made(path, mode)
            return readers[key]

        # transformers imports both from the package at each use
        gguf.GGUFReader, gguf.get_tensor_name_map = shared, functools.cache(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = made, name_map


def load_target(path: str | Path | None, device: torch.device, dtype: torch.dtype,
                tokenizer: str | Path | None = None, cache: StartCache | None = None,
                shard: tuple[int, int] | None = None) -> Target:
    """The target; `tokenizer` (a tokenizer folder) gives a random target's vocabulary and is refused otherwise. A
    GGUF is converted to a model folder in `cache` at its first load, so later loads skip the GGUF's slow reading.
    shard (rank, world): the model cut to that tensor-parallel shard; from a safetensors folder (a converted GGUF's
    too) only the shard's slices are read (tensor_parallel.load_shard)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .tensor_parallel import load_shard, shard_model

    if isinstance(path, str) and path.startswith(RANDOM_PREFIX):
        target = load_random_target(path, device, dtype, tokenizer=tokenizer)
        if shard is not None:
            shard_model(target.model, *shard)
        return target
    if tokenizer is not None:
        raise ValueError("a tokenizer folder applies to random targets only")
    path = Path(path) if path is not None else default_model_path()
    if not path.exists():
        raise FileNotFoundError(f"target model {path} does not exist (a .gguf file or a Hugging Face folder)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"target {path} is a file but not a .gguf; give a GGUF file or a model folder")
        kwargs = {"gguf_file": path.name}
        folder = str(path.parent)
        kept = cache.get_folder("target", gguf_key(path, dtype)) if cache is not None else None
        if kept is not None:
            log.info("target %s as converted at an earlier start (%s)", path.name, kept)
            kwargs, folder = {}, str(kept)
    else:
        if not (path / "config.json").is_file():  # transformers would blame a missing tokenizer converter first
            raise ValueError(f"target {path} is a folder without config.json; give a Hugging Face model folder "
                             "(config.json, weights, tokenizer) or a GGUF file")
        kwargs = {}
        folder = str(path)
    from transformers import AutoConfig

    from .model_runner import check_architecture

    with one_gguf_read() if "gguf_file" in kwargs else nullcontext():
        config = AutoConfig.from_pretrained(folder, **kwargs)
        check_architecture(config)  # before reading any weights
        log.info("loading target %s (%s, %s)", path, device, dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        sliced = shard is not None and "gguf_file" not in kwargs and any(Path(folder).glob("*.safetensors"))
        if sliced:
            log.info("tensor-parallel rank %d of %d: reading its slices of %s", shard[0], shard[1], folder)
            model = load_shard(Path(folder), config, dtype, *shard).to(device)
        else:  # the config passed on, so a GGUF's is not built twice
            model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dtype,
                                                         **kwargs).to(device).eval()
    vocab_size = int(model.config.vocab_size)
    tokens = vocab_tokens(tokenizer, vocab_size)
    eos = model.config.eos_token_id
    eos_ids = tuple(eos if isinstance(eos, (list, tuple)) else [eos]) if eos is not None else ()
    if cache is not None and "gguf_file" in kwargs:
        cache.put_folder("target", gguf_key(path, dtype), lambda into: save_folder(model, tokenizer, into))
    if shard is not None and not sliced:  # after the whole model was kept
        shard_model(model, *shard)
    return Target(model=model, name=path.name, vocab_tokens=tokens, eos_token_ids=eos_ids,
                  fingerprint=vocab_fingerprint(tokens), tokenizer=tokenizer)


def gguf_key(path: Path, dtype: torch.dtype) -> dict:
    """What a GGUF's conversion depends on: the file as it is now, the dtype and the converting libraries."""
    import gguf
    import transformers

    stat = path.resolve().stat()
    return {"gguf": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "dtype": str(dtype),
            "transformers": transformers.__version__, "gguf_reader": getattr(gguf, "__version__", "")}


def save_folder(model: torch.nn.Module, tokenizer, folder: Path) -> None:
    """A model loaded from a GGUF as a Hugging Face folder (config, safetensors, tokenizer): transformers keeps GGUF
    models from save_pretrained, so the weights go through safetensors, tied ones once."""
    from safetensors.torch import save_model

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_model(model, str(folder / "model.safetensors"))
    tokenizer.save_pretrained(str(folder))


@torch.no_grad()
def stabilize(model: torch.nn.Module) -> None:
    """Make a random Llama's greedy text stable under rounding, as a trained model's is.

    With the usual initialisation (every weight N(0, 0.02)) each layer adds to the residual stream far more than the
    token embedding it starts from, and the top two of the 49,152 logits end within rounding of each other: the greedy
    text then changes with the batch a token is verified in (bfloat16 on a GPU), and drafts synthesized from a
    recorded greedy text stop matching after the first flip. Here the embeddings are N(0, 1) and every layer's
    output projections are scaled by 0.1, so the residual stream keeps its token; the logits read the embeddings
    (tied, or copied into an untied lm_head), so the top logit leads by about |e|^2 = hidden_size against the
    others' ~4.5 sqrt(hidden_size). The greedy text then repeats the prompt's last token. A step's arithmetic and
    memory traffic are those of the shape, whatever the values."""
    embed = model.model.embed_tokens.weight
    embed.normal_(0.0, 1.0)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.mul_(0.1)
        layer.mlp.down_proj.weight.mul_(0.1)
    if model.lm_head.weight.data_ptr() != embed.data_ptr():
        model.lm_head.weight.copy_(embed)


def load_random_target(spec: str, device: torch.device, dtype: torch.dtype, seed: int = 0,
                       tokenizer: str | Path | None = None) -> Target:
    """A model of the shape `spec` names (Llama unless it says otherwise), with random weights (seeded), the default GGUF's vocabulary and tokens
    (or those of the tokenizer folder `tokenizer`, exported from it where the GGUF is not installed).

    Built directly on `device`: an 8B shape never passes through host memory. Its text is meaningless, but its
    step times are those of a real model of that shape, which is what a capacity run needs. Families without
    Gemma's post-norms are stabilized (stabilize()); a Gemma's norms undo the scaling, so it is left as built."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .model_runner import Family

    shape = random_target_shape(spec)
    tokenizer = vocabulary_tokenizer(tokenizer)
    vocab_size = len(tokenizer)
    tokens = vocab_tokens(tokenizer, vocab_size)
    eos = tokenizer.eos_token_id
    kind = shape.pop("model_type", "llama")
    stable = shape.pop("stabilize", True)  # false: the usual initialisation, e.g. for tests of sampling
    try:
        config = AutoConfig.for_model(kind, vocab_size=vocab_size, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=eos,
                                      max_position_embeddings=max(8192, shape.pop("max_position_embeddings", 0)),
                                      **shape)
    except (ValueError, TypeError) as err:
        raise ValueError(f"random target {spec}: {err}") from None
    family = Family.of(config)
    log.info("building a random-weight target %s (%s, %s, seed %d)", spec, device, dtype, seed)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
        if stable and not family.gemma:
            stabilize(model)
        model = model.to(dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    return Target(model=model, name=f"{spec} ({params / 1e9:.2f}B parameters, random weights)", vocab_tokens=tokens,
                  eos_token_ids=(eos,) if eos is not None else (), fingerprint=vocab_fingerprint(tokens),
                  tokenizer=tokenizer)
