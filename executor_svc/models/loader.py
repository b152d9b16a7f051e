"""Build a model and fill its weights from a Hugging Face folder (safetensors) or at random (dummy).

Weights stream one tensor at a time from the memory-mapped safetensors files into the parameters
(already on the target device, in the target dtype, at this rank's shard size), through each
parameter's `weight_loader`. A checkpoint tensor reaches the loader as a `CheckpointTensor`, which
reads nothing until the loader narrows it to this rank's rows or columns (safetensors `get_slice`), so
a tensor-parallel rank reads only its own shard: no rank ever holds the whole model, nor even one
whole sharded tensor.
"""

from __future__ import annotations

import collections
import contextlib
import json
import pathlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from executor_svc.layers.linear import VocabParallelEmbedding
from executor_svc.models.config import ModelConfig
from executor_svc.models.registry import model_class

LOAD_FORMATS = ("auto", "safetensors", "dummy")
EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")  # Mixtral / Qwen MoE: one tensor per expert
DUMMY_STD = 0.02


class WeightLoadError(ValueError):
    """The checkpoint does not match the model (missing, unexpected or mis-shaped tensors)."""


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    model_dir: str | pathlib.Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    tp_rank: int = 0,
    tp_size: int = 1,
    seed: int = 0,
) -> nn.Module:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    with _default_dtype(dtype), torch.device(device):
        model = model_class(config)(config, tp_rank, tp_size)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_safetensors(model, model_dir)
    return model.eval()


def safetensors_files(model_dir: str | pathlib.Path) -> list[pathlib.Path]:
    folder = pathlib.Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors in {folder}")
    return files


class CheckpointTensor:
    """One tensor of a safetensors file, not read yet. `narrow(dim, start, length)` reads only that
    range (the weight loaders' only way in, the same call as on a torch.Tensor); `read()` reads it all.
    Bytes read are added to `stats.num_bytes_read`."""

    def __init__(self, handle, name: str, stats: LoadStats):
        self._slice = handle.get_slice(name)
        self.name = name
        self.shape = torch.Size(self._slice.get_shape())
        self._stats = stats

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ValueError(
                f"range {start}..{start + length} of dim {dim} exceeds the shape {tuple(self.shape)}"
            )
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        part = self._slice[tuple(index)]
        self._stats.num_bytes_read += part.numel() * part.element_size()
        return part

    def read(self) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0]) if self.shape else self._slice[()]


@dataclass(slots=True)
class LoadStats:
    num_tensors: int = 0
    num_bytes_read: int = 0


def iterate_checkpoint(
    model_dir: str | pathlib.Path, stats: LoadStats | None = None
) -> Iterator[tuple[str, CheckpointTensor]]:
    stats = LoadStats() if stats is None else stats
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                stats.num_tensors += 1
                yield name, CheckpointTensor(f, name, stats)


def load_safetensors(model: nn.Module, model_dir: str | pathlib.Path) -> LoadStats:
    """Fills every parameter from the checkpoint; returns how many tensors and bytes were read."""
    stats = LoadStats()
    params = dict(model.named_parameters())
    stacked = getattr(model, "STACKED_PARAMS", ())
    renames = getattr(model, "CHECKPOINT_RENAMES", ())
    expert_params = getattr(model, "EXPERT_PARAMS", {})
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    expert_shards: dict[str, set] = {}
    for hf_name, tensor in iterate_checkpoint(model_dir, stats):
        if "rotary_emb.inv_freq" in hf_name or (tied and hf_name == "lm_head.weight"):
            continue
        name = hf_name if hf_name in params or hf_name.startswith("model.") else "model." + hf_name
        for theirs, ours in renames:
            name = name.replace(theirs, ours)
        name, shard_id = _expert_param(name, expert_params)
        for ours, theirs, shard in stacked if shard_id is None else ():
            if theirs in name:
                name, shard_id = name.replace(theirs, ours), shard
                break
        param = params.get(name)
        if param is None:
            raise WeightLoadError(f"checkpoint tensor {hf_name!r} has no place in {type(model).__name__}")
        try:
            _load_one(param, tensor, shard_id)
        except (ValueError, RuntimeError) as e:
            raise WeightLoadError(f"{hf_name}: {e}") from e
        loaded.add(name)
        if isinstance(shard_id, tuple):
            expert_shards.setdefault(name, set()).add(shard_id)
    parts_per_param = collections.Counter(ours for ours, _ in expert_params.values())
    for name, shards in expert_shards.items():
        expected = params[name].shape[0] * parts_per_param[name.rsplit(".", 1)[1]]
        if len(shards) != expected:
            raise WeightLoadError(f"checkpoint holds {len(shards)} of the {expected} expert tensors: {name}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise WeightLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
    return stats


def _expert_param(name: str, expert_params: dict[str, tuple[str, str]]) -> tuple[str, object]:
    """`...experts.N.<proj>.weight` -> (`...experts.<our stacked param>`, (N, part)); other names as
    they are, with no shard id."""
    match = EXPERT_NAME.search(name)
    if match is None or match.group(2) not in expert_params:
        return name, None
    ours, part = expert_params[match.group(2)]
    return f"{name[: match.start()]}.experts.{ours}", (int(match.group(1)), part)


@torch.no_grad()
def _load_one(param: nn.Parameter, tensor: CheckpointTensor, shard_id) -> None:
    loader = getattr(param, "weight_loader", None)
    if loader is None:  # replicated on every rank (norms, OPT's positions): read whole
        if param.shape != tensor.shape:
            raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(tensor.read())
    elif shard_id is None:
        loader(param, tensor)
    else:
        loader(param, tensor, shard_id)


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = DUMMY_STD) -> None:
    """Random weights of the real shapes, generated in place in the parameter's dtype and device.

    Each tensor-parallel rank draws only its own shards, where they already are (a 70B model at
    TP = 2 never exists whole, neither on the CPU nor on one GPU). The seed of a parameter depends on
    its name alone, so replicated tensors (OPT's positions) are equal on every rank, as they must be.
    Norm scales are 1 and biases 0, so activations keep a sane size through many layers. The padding
    rows of a vocabulary shard are zero, as the safetensors loader leaves them.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                gen = torch.Generator(device=param.device)
                gen.manual_seed(seed + hash_name(name))
                param.normal_(0.0, std, generator=gen)
        for module in model.modules():
            if isinstance(module, VocabParallelEmbedding):
                real_rows = max(0, min(module.num_rows, module.vocab_size - module.vocab_start))
                module.weight[real_rows:].zero_()


def hash_name(name: str) -> int:
    """A stable (not per-process salted) small hash of a parameter name."""
    value = 0
    for byte in name.encode():
        value = (value * 131 + byte) % 1_000_003
    return value
