"""`pagedserve make-tiny-model DIR`: a tiny random-weight model folder with a real tokenizer."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="folder to write (config.json, model.safetensors, tokenizer.json)")
    parser.add_argument("--family", choices=("llama", "qwen2", "qwen3", "opt"), default="llama")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from executor_svc.models.tiny import make_tiny_model  # needs torch: imported only here

    folder = make_tiny_model(args.dir, args.family, seed=args.seed)
    print(folder)
    return 0
