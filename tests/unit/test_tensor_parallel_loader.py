"""Tensor-parallel weight loading reads only this rank's shard from the safetensors files: through
`get_slice` (never `get_tensor`), exactly as many bytes as the rank's own parameters hold, and the
ranks' shards put side by side are the checkpoint's tensors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import executor_svc.models.loader as loader_module
from executor_svc.models.config import ModelConfig
from executor_svc.models.loader import _default_dtype, load_safetensors
from executor_svc.models.registry import model_class
from tests.helpers.checkpoints import copy_with


class _SliceSpy:
    def __init__(self, inner, log: list[int]):
        self._inner, self._log = inner, log

    def get_shape(self):
        return self._inner.get_shape()

    def __getitem__(self, index):
        part = self._inner[index]
        self._log.append(part.numel() * part.element_size())
        return part


class _HandleSpy:
    """safe_open's handle, counting the bytes its slices return and refusing whole-tensor reads."""

    def __init__(self, inner, log: list[int]):
        self._inner, self._log = inner, log

    def keys(self):
        return self._inner.keys()

    def get_slice(self, name):
        return _SliceSpy(self._inner.get_slice(name), self._log)

    def get_tensor(self, name):
        raise AssertionError(f"the loader read the whole tensor {name}")


def _load_rank(model_dir, rank: int, tp_size: int, monkeypatch) -> tuple[torch.nn.Module, int, int]:
    """(model shard, bytes read from the files as the spy saw them, bytes LoadStats counted)."""
    real_open, log = loader_module.safe_open, list[int]()  # bytes per tensor read

    class SpyOpen:
        def __init__(self, *args, **kwargs):
            self._cm = real_open(*args, **kwargs)

        def __enter__(self):
            return _HandleSpy(self._cm.__enter__(), log)

        def __exit__(self, *exc):
            return self._cm.__exit__(*exc)

    monkeypatch.setattr(loader_module, "safe_open", SpyOpen)
    config = ModelConfig.from_dir(model_dir)
    with _default_dtype(torch.float32):
        model = model_class(config)(config, rank, tp_size)
    stats = load_safetensors(model, model_dir)
    return model, sum(log), stats.num_bytes_read


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt"])
def test_each_rank_reads_only_its_shard_through_get_slice(family, tiny_model_dirs, monkeypatch):
    model_dir = tiny_model_dirs[family]
    checkpoint = load_file(str(model_dir / "model.safetensors"))  # fp32, as the models' params
    checkpoint_bytes = sum(t.numel() * t.element_size() for t in checkpoint.values())
    shards = []
    for rank in range(2):
        model, spied, counted = _load_rank(model_dir, rank, 2, monkeypatch)
        own_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied counted once
        assert spied == counted == own_bytes
        shards.append(model)
        if family == "llama":  # only norms are replicated: well under 60 % of the checkpoint per rank
            assert own_bytes < 0.6 * checkpoint_bytes

    attn = [
        m.model.layers[0].self_attn if family != "opt" else m.model.decoder.layers[0].self_attn
        for m in shards
    ]
    prefix = "model.decoder.layers.0.self_attn." if family == "opt" else "model.layers.0.self_attn."
    q_rows = attn[0].qkv_proj.num_heads * attn[0].qkv_proj.head_dim
    kv_rows = attn[0].qkv_proj.num_kv_heads * attn[0].qkv_proj.head_dim
    q = torch.cat([a.qkv_proj.weight[:q_rows] for a in attn])
    v = torch.cat([a.qkv_proj.weight[q_rows + kv_rows :] for a in attn])
    assert torch.equal(q, checkpoint[prefix + "q_proj.weight"])
    assert torch.equal(v, checkpoint[prefix + "v_proj.weight"])
    out = "out_proj" if family == "opt" else "o_proj"
    assert torch.equal(
        torch.cat([getattr(a, out).weight for a in attn], dim=1), checkpoint[prefix + out + ".weight"]
    )
    embed_name = "model.decoder.embed_tokens.weight" if family == "opt" else "model.embed_tokens.weight"
    embeds = [m.model.decoder.embed_tokens if family == "opt" else m.model.embed_tokens for m in shards]
    assert torch.equal(torch.cat([e.weight for e in embeds]), checkpoint[embed_name])


@pytest.mark.parametrize("rank", [0, 1])
def test_a_short_checkpoint_tensor_fails_on_every_rank_naming_it(
    rank, tiny_model_dirs, tmp_path, monkeypatch
):
    """A vocabulary table shorter than the config's vocabulary is refused by the rank whose rows
    exist (no silent zero padding) and by the rank whose rows do not."""
    src = tiny_model_dirs["llama"]
    weights = load_file(str(src / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"][:300].clone()
    with pytest.raises(
        loader_module.WeightLoadError,
        match=r"lm_head.weight: vocabulary table: checkpoint tensor has shape \(300, 64\)",
    ):
        _load_rank(copy_with(tmp_path, src, weights), rank, 2, monkeypatch)
    wrong = weights | {"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 100)}
    wrong["lm_head.weight"] = load_file(str(src / "model.safetensors"))["lm_head.weight"]
    with pytest.raises(
        loader_module.WeightLoadError,
        match=r"down_proj.weight: row-parallel: .* shape \(64, 100\), expected \(64, 128\)",
    ):
        _load_rank(copy_with(tmp_path / "b", src, wrong), rank, 2, monkeypatch)
