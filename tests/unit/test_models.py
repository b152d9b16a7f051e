"""Our models on the paged KV cache against Hugging Face transformers (CPU, fp32).

Every sequence's logits at the end of its prompt and at 32 greedy decode steps must match
`AutoModelForCausalLM` run with its own KV cache (max abs diff <= 1e-4), and the greedy tokens must be
identical. Batches mix sequences of different lengths at different phases; block ids are scattered;
block tables grow through plan diffs; some prompts are prefilled in chunks and one starts from blocks
another sequence computed earlier (prefix caching).
"""

from __future__ import annotations

import random

import pytest
import torch

from executor_svc.worker.worker import Worker
from scheduler_svc.wire.sampling_params import SamplingParams
from scheduler_svc.wire.step_plan import ContinuingSequence, NewSequence, StepPlan

FAMILIES = (
    "llama", "qwen2", "qwen3", "opt", "mixtral", "qwen3_moe", "qwen2_moe", "gemma2", "gemma3", "phi3",
    "granite",
)
# HF's sdpa path drops Gemma 2's attention soft-capping: the model's own semantics are eager's
HF_ATTENTION = {"gemma2": "eager", "gemma3": "eager"}
NUM_DECODE = 32
BLOCK_SIZE = 8
ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_DECODE + 1)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(length)]


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], num_decode: int) -> tuple[torch.Tensor, list[int]]:
    """Logits [1 + num_decode, V] and greedy tokens of HF transformers with its own KV cache."""
    out = model(torch.tensor([prompt]), use_cache=True)
    logits, tokens = [out.logits[0, -1]], [int(out.logits[0, -1].argmax())]
    for _ in range(num_decode):
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits[0, -1])
        tokens.append(int(out.logits[0, -1].argmax()))
    return torch.stack(logits), tokens


class Driver:
    """Plays the scheduler: schedules chunks / decode steps, grows block tables by diffs, and records
    the logits of every sampled row (a spy on the runner)."""

    def __init__(self, worker: Worker, rng: random.Random):
        self.worker, self.step_id = worker, 0
        self.free_blocks = list(range(worker.num_gpu_blocks))
        rng.shuffle(self.free_blocks)
        self.seqs: dict[int, dict] = {}
        runner = worker._ensure_cache()
        compute = runner.compute_logits
        self.captured: dict[int, torch.Tensor] = {}

        def spy(batch):
            logits = compute(batch)
            for row, seq_id in enumerate(batch.sampled_seq_ids):
                self.captured[seq_id] = logits[row].clone()
            return logits

        runner.compute_logits = spy
        runner.graph_sampling = False  # every step through compute_logits (ModelRunner.execute)

    def add(
        self,
        seq_id: int,
        prompt: list[int],
        chunks: list[int],
        num_computed: int = 0,
        shared_blocks: tuple[int, ...] = (),
    ) -> None:
        self.seqs[seq_id] = dict(
            tokens=list(prompt),
            chunks=list(chunks),
            computed=num_computed,
            blocks=list(shared_blocks),
            sent=False,
            logits=[],
            out=[],
        )

    def _blocks_for(self, seq: dict, num_tokens: int) -> list[int]:
        need = -(-num_tokens // BLOCK_SIZE) - len(seq["blocks"])
        new = [self.free_blocks.pop() for _ in range(max(0, need))]
        seq["blocks"].extend(new)
        return new

    def step(self, seq_ids: list[int]) -> None:
        plan = StepPlan(self.step_id)
        for seq_id in seq_ids:
            seq = self.seqs[seq_id]
            n = seq["chunks"].pop(0) if seq["chunks"] else 1
            start = len(seq["blocks"])
            new_blocks = self._blocks_for(seq, seq["computed"] + n)
            if not seq["sent"]:
                plan.new_seqs.append(
                    NewSequence(
                        seq_id,
                        list(seq["tokens"]),
                        seq["computed"],
                        n,
                        list(seq["blocks"]),
                        GREEDY,
                        prompt_len=len(seq["tokens"]),
                    )
                )
                seq["sent"] = True
            else:
                pending = seq.pop("pending", [])
                plan.cont_seqs.append(ContinuingSequence(seq_id, n, pending, start, new_blocks))
            seq["computed"] += n
        result = self.worker.execute(plan)
        self.step_id += 1
        for sample in result.samples:
            seq = self.seqs[sample.seq_id]
            seq["logits"].append(self.captured.pop(sample.seq_id))
            seq["out"].append(sample.token_id)
            seq["tokens"].append(sample.token_id)
            seq["pending"] = [sample.token_id]
        assert sorted(s.seq_id for s in result.samples) == sorted(
            i for i in seq_ids if self.seqs[i]["computed"] == len(self.seqs[i]["tokens"]) - 1
        )

    def active(self) -> list[int]:
        return [i for i, s in self.seqs.items() if len(s["out"]) < NUM_DECODE + 1]


@pytest.fixture(scope="module")
def hf_models(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    return {
        f: AutoModelForCausalLM.from_pretrained(
            tiny_model_dirs[f], dtype=torch.float32, attn_implementation=HF_ATTENTION.get(f, "sdpa")
        ).eval()
        for f in FAMILIES
    }


def make_worker(model_dir) -> Worker:
    return Worker(
        str(model_dir),
        device="cpu",
        dtype="float32",
        num_gpu_blocks=96,
        num_cpu_blocks=8,
        block_size=BLOCK_SIZE,
    )


def assert_matches_hf(hf_model, seq: dict, prompt: list[int]) -> None:
    ref_logits, ref_tokens = hf_greedy(hf_model, prompt, NUM_DECODE)
    assert seq["out"] == ref_tokens
    diff = (torch.stack(seq["logits"]) - ref_logits).abs().max().item()
    assert diff <= ATOL, f"max abs logit diff {diff}"


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_with_chunked_prefill_matches_hf(family, tiny_model_dirs, hf_models):
    rng = random.Random(FAMILIES.index(family))
    driver = Driver(make_worker(tiny_model_dirs[family]), rng)
    prompts = {
        1: random_prompt(rng, 5),
        2: random_prompt(rng, 19),
        3: random_prompt(rng, 33),
        4: random_prompt(rng, 12),
    }
    driver.add(1, prompts[1], [5])  # whole prompt at once
    driver.add(2, prompts[2], [19])
    driver.add(3, prompts[3], [7, 7, 9, 10])  # chunked, chunk ends not on block boundaries
    driver.add(4, prompts[4], [3, 9])  # joins at step 2, while the others decode
    step = 0
    while active := driver.active():
        driver.step([i for i in active if i != 4 or step >= 2])
        step += 1
    for seq_id, prompt in prompts.items():
        assert_matches_hf(hf_models[family], driver.seqs[seq_id], prompt)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_served_partly_from_cached_blocks_matches_hf(family, tiny_model_dirs, hf_models):
    rng = random.Random(7)
    driver = Driver(make_worker(tiny_model_dirs[family]), rng)
    donor = random_prompt(rng, 21)
    driver.add(1, donor, [21])
    driver.step([1])
    # Sequence 2 shares the donor's first two full blocks (16 tokens): only its tail is computed.
    prompt = donor[:16] + random_prompt(rng, 11)
    driver.add(2, prompt, [11], num_computed=16, shared_blocks=tuple(driver.seqs[1]["blocks"][:2]))
    while active := driver.active():
        driver.step(active)
    assert_matches_hf(hf_models[family], driver.seqs[1], donor)
    assert_matches_hf(hf_models[family], driver.seqs[2], prompt)


VARIANTS = {
    # OPT-350m's shape: norms after the residual adds, no final norm, embeddings projected 32 <-> 64.
    "opt-350m-like": ("opt", dict(do_layer_norm_before=False, word_embed_proj_dim=32)),
    # An OPT checkpoint with its own lm_head (tie_word_embeddings false).
    "opt-untied": ("opt", dict(tie_word_embeddings=False)),
    # Mistral with a sliding window shorter than the prompts + decode steps (every layer windowed).
    "mistral-sliding-window": (
        "llama", dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=7)
    ),
    # Context extension: YaRN (Qwen2.5 / DeepSeek style, with attention temperature) and dynamic NTK.
    "llama-yarn": (
        "llama",
        dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 512}),
    ),
    "qwen2-yarn-mscale": (
        "qwen2",
        dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 8.0, "mscale": 0.707,
                              "mscale_all_dim": 1.0, "beta_fast": 16,
                              "original_max_position_embeddings": 256}),
    ),
    "qwen3-dynamic": (
        "qwen3", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    ),
    # Llama-2-like: MHA, plain rope; tied embeddings as in Llama 3.2 1B.
    "llama-mha-tied": (
        "llama",
        dict(
            num_key_value_heads=4,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_architecture_variants_match_hf(variant, tmp_path):
    from transformers import AutoModelForCausalLM

    from executor_svc.models.tiny import make_tiny_model

    family, overrides = VARIANTS[variant]
    folder = make_tiny_model(tmp_path / variant, family, seed=2, **overrides)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rng = random.Random(11)
    driver = Driver(make_worker(folder), rng)
    prompts = {1: random_prompt(rng, 13), 2: random_prompt(rng, 4)}
    driver.add(1, prompts[1], [6, 7])
    driver.add(2, prompts[2], [4])
    while active := driver.active():
        driver.step(active)
    for seq_id, prompt in prompts.items():
        assert_matches_hf(hf_model, driver.seqs[seq_id], prompt)
