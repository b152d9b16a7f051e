"""`pagedserve make-tiny-model DIR`: a tiny random-weight model folder with a real tokenizer."""

from __future__ import annotations

import argparse

# executor_svc.models.tiny.FAMILIES without importing torch (tests/unit/test_tiny_model.py checks)
TINY_FAMILIES = (
    "llama", "qwen2", "qwen3", "opt", "mixtral", "qwen3_moe", "qwen2_moe", "gemma2", "gemma3", "phi3",
    "granite",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="folder to write (config.json, model.safetensors, tokenizer.json)")
    parser.add_argument("--family", choices=TINY_FAMILIES, default="llama")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from executor_svc.models.tiny import make_tiny_model  # needs torch: imported only here

    folder = make_tiny_model(args.dir, args.family, seed=args.seed)
    print(folder)
    return 0
