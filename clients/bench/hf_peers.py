"""The Hugging Face transformers peers of the benchmarks (docs/workloads.md), run in-process on the same
GPU, model shape and requests as pagedserve:

- `static`: `model.generate` over padded batches in arrival order; a batch runs until its longest
  request ends (the FasterTransformer-style baseline of the paper).
- `continuous`: transformers' own continuous batching (`init_continuous_batching`, paged cache).

Every request generates exactly its `max_tokens` (EOS is ignored), so all engines produce the same
number of tokens; throughput counts each request's own output tokens only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig


@dataclass(frozen=True, slots=True)
class PeerResult:
    peer: str
    num_requests: int
    output_tokens: int
    elapsed_s: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "peer": self.peer,
            "num_requests": self.num_requests,
            "output_tokens": self.output_tokens,
            "elapsed_s": round(self.elapsed_s, 4),
            "output_tok_s": round(self.output_tok_s, 2),
        }


def load_peer_model(model_dir: str, dtype: torch.dtype, device: str, dummy: bool):
    """The HF model on `device`; with `dummy`, random weights of the shape in config.json."""
    if dummy:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        for p in model.parameters():  # small weights keep activations finite in bf16
            p.data.normal_(0.0, 0.02)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    return model.eval()


def _never_stop_config(model, max_new_tokens: int) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=model.config.bos_token_id,
    )


@torch.inference_mode()
def run_static(model, prompts: list[list[int]], max_tokens: list[int], batch_size: int) -> PeerResult:
    device = model.device
    start = time.perf_counter()
    for begin in range(0, len(prompts), batch_size):
        batch, lens = prompts[begin : begin + batch_size], max_tokens[begin : begin + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # [B, S], left-padded
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            generation_config=_never_stop_config(model, max(lens)),
        )
        assert out.shape[1] == width + max(lens), "static peer stopped early"
    if device.type == "cuda":
        torch.cuda.synchronize()
    return PeerResult("hf-static", len(prompts), sum(max_tokens), time.perf_counter() - start)


@torch.inference_mode()
def run_continuous(
    model, prompts: list[list[int]], max_tokens: list[int], num_blocks: int | None = None
) -> PeerResult:
    """`num_blocks=None` lets transformers size its paged cache from free GPU memory (it cannot on
    CPU, where a count must be given)."""
    config = _never_stop_config(model, max(max_tokens))
    config.eos_token_id = -1  # continuous batching's way of saying "no EOS"
    cb_config = None
    if num_blocks is not None:
        cb_config = ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=256, block_size=16)
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config)
    manager.start()
    try:
        start = time.perf_counter()
        ids = [
            manager.add_request(prompt, max_new_tokens=n, eos_token_id=-1)
            for prompt, n in zip(prompts, max_tokens, strict=True)
        ]
        pending = set(ids)
        produced = 0
        while pending:
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError("transformers continuous batching stopped before finishing")
            if result.request_id in pending and result.is_finished():
                pending.discard(result.request_id)
                produced += len(result.generated_tokens)
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    if produced != sum(max_tokens):
        raise RuntimeError(f"continuous peer produced {produced} tokens, expected {sum(max_tokens)}")
    return PeerResult("hf-cb", len(prompts), produced, elapsed)
