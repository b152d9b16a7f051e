"""Model folders with modified weights, for loader tests."""

from __future__ import annotations

import pathlib
import shutil

import torch
from safetensors.torch import save_file


def copy_with(tmp_path: pathlib.Path, src: pathlib.Path, weights: dict[str, torch.Tensor]) -> pathlib.Path:
    """A copy of the model folder `src` (config, tokenizer) under tmp_path/model holding `weights`."""
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    save_file(weights, str(dst / "model.safetensors"))
    return dst
