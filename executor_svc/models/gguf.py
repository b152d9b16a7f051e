"""A GGUF file (llama.cpp's format) converted into a Hugging Face model folder the executors serve.

Transformers' GGUF loader reads and dequantizes the file (it needs the `gguf` and `accelerate`
packages); this module writes what it loaded as a plain folder: `config.json`, `model.safetensors`
(float32: the exact dequantized values; the executor casts to its serving dtype), `tokenizer.json`,
`tokenizer_config.json` (with the chat template and the special tokens) and `generation_config.json`
(bos / eos / pad ids). The folder is written beside its destination and renamed into place, so an
interrupted conversion leaves nothing half-written behind.

    python -m executor_svc.models.gguf FILE.gguf OUT_DIR

The launcher (`pagedserve serve`) runs that command in a subprocess, so it never imports torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import time

NEEDED_PACKAGES = ("gguf", "accelerate")  # transformers' GGUF loader imports them
PIP_INSTALL = "pip install gguf==0.19.0 accelerate==1.15.0   (or: pip install -e '.[default-model]')"
CONFIG_KEYS_DROPPED = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")


class GGUFConversionError(RuntimeError):
    """The file cannot be converted (a missing package, an unsupported architecture)."""


def check_packages() -> None:
    missing = [name for name in NEEDED_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise GGUFConversionError(
            f"reading GGUF files needs the package(s) {', '.join(missing)}: {PIP_INSTALL}"
        )


def convert(gguf_path: str | pathlib.Path, out_dir: str | pathlib.Path) -> pathlib.Path:
    """Converts `gguf_path` into the model folder `out_dir` (replaced if it exists); returns it."""
    check_packages()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from executor_svc.models.families import UnsupportedArchitectureError, family_of

    src = pathlib.Path(gguf_path).resolve()
    out = pathlib.Path(out_dir)
    if not src.is_file():
        raise GGUFConversionError(f"{src}: no such file")
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        config = model.config.to_dict()
        try:
            family_of(config)  # before writing: an architecture the executors cannot serve
        except UnsupportedArchitectureError as err:
            raise GGUFConversionError(f"{src.name}: {err}") from None
        _write_weights(model, tmp / "model.safetensors")
        for key in CONFIG_KEYS_DROPPED:
            config.pop(key, None)
        config["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _write_tokenizer(tokenizer, config, tmp)
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_weights(model, path: pathlib.Path) -> None:
    """The state dict once per tensor: a tied lm_head is left out (every loader re-ties it)."""
    from safetensors.torch import save_file

    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(
        {name: t.detach().contiguous() for name, t in state.items()}, str(path), metadata={"format": "pt"}
    )


def _write_tokenizer(tokenizer, config: dict, folder: pathlib.Path) -> None:
    """tokenizer.json and tokenizer_config.json. The special tokens are named after config.json's
    ids (the GGUF reader can name the wrong one), and the chat template sits in tokenizer_config.json
    (what servers and clients read), not in a separate chat_template.jinja."""
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    path = folder / "tokenizer_config.json"
    tok_config = json.loads(path.read_text()) if path.exists() else {}
    for name in ("bos", "eos", "pad", "unk"):
        token_id = config.get(f"{name}_token_id")
        if isinstance(token_id, list):
            token_id = token_id[0] if token_id else None
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            tok_config[f"{name}_token"] = tokenizer.convert_ids_to_tokens(token_id)
            tok_config[f"{name}_token_id"] = token_id
        else:
            tok_config.pop(f"{name}_token_id", None)
    if tokenizer.chat_template:
        tok_config["chat_template"] = tokenizer.chat_template
    path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m executor_svc.models.gguf", description=__doc__.split("\n")[0]
    )
    parser.add_argument("gguf_file")
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    size_mb = pathlib.Path(args.gguf_file).stat().st_size / 1e6 if os.path.exists(args.gguf_file) else 0.0
    print(
        f"pagedserve: converting {args.gguf_file} ({size_mb:.0f} MB) into {args.out_dir} (once) ...",
        file=sys.stderr,
        flush=True,
    )
    start = time.monotonic()
    try:
        convert(args.gguf_file, args.out_dir)
    except Exception as err:  # a malformed file fails in many ways inside the readers: one line each
        print(f"pagedserve: cannot convert {args.gguf_file}: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(f"pagedserve: converted in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
