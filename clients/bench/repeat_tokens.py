"""`bench repeat`'s comparisons of token ids: within one server's runs, and against a file of tokens
that another server wrote (`--save-tokens` / `--compare-tokens`), so that a server with a small KV
cache (forced preemption, swap or recompute) and small steps (chunked prefill) can be checked
against one with room for everything.

The file holds what identifies the request set (`RequestSet`: a reference is usable only for the
same prompts and token budget), the server flags of its run, run A's tokens per request, and the
seeded target's tokens per batch size:

    {"version": 1, "model": ..., "request_set": {...}, "server": {...},
     "run_a": [{"tokens": [...], "finished": true}, ...],
     "seeded": {"sampling": {...}, "batches": [{"batch_size": 1, "tokens": [...], "finished": true}, ...]}}
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import statistics
from dataclasses import asdict, dataclass, field

TOKENS_FILE_VERSION = 1


@dataclass(slots=True)
class Generation:
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    error: str | None = None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def same_tokens(a: Generation, b: Generation) -> bool:
    return a.finished and b.finished and a.tokens == b.tokens


def agreement(reference: list[Generation], other: list[Generation]) -> dict:
    """How many requests of `other` repeat `reference`'s tokens exactly, the mean agreement (common
    prefix / the longer length), and where the differing ones first differ (token positions)."""
    pairs = list(zip(reference, other, strict=True))
    prefixes = [common_prefix(a.tokens, b.tokens) for a, b in pairs]
    ratios = [p / max(len(a.tokens), len(b.tokens), 1) for p, (a, b) in zip(prefixes, pairs, strict=True)]
    differing = [p for p, (a, b) in zip(prefixes, pairs, strict=True) if not same_tokens(a, b)]
    first = None
    if differing:
        first = {"num": len(differing), "min": min(differing), "median": statistics.median(differing),
                 "max": max(differing)}
    return {
        "num_requests": len(pairs),
        "num_identical": len(pairs) - len(differing),
        "mean_agreement": round(statistics.fmean(ratios), 6) if ratios else None,
        "first_difference": first,
    }


# ---- the tokens file ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestSet:
    """What makes two runs' requests the same: the workload seed, the counts, the vocabulary the
    prompts are drawn from, and (since the prompt lengths also depend on the model's length) the
    prompts themselves, as lengths and a digest of every token id (the seeded target's included)."""

    seed: int
    requests: int
    max_tokens: int
    vocab_size: int
    prompt_lens: tuple[int, ...]
    target_prompt_len: int
    prompts_sha256: str

    @classmethod
    def of(cls, seed: int, max_tokens: int, vocab_size: int, prompts: list[list[int]],
           target_prompt: list[int]) -> RequestSet:
        digest = hashlib.sha256(json.dumps([prompts, target_prompt]).encode()).hexdigest()
        return cls(seed, len(prompts), max_tokens, vocab_size, tuple(len(p) for p in prompts),
                   len(target_prompt), digest)

    def to_json(self) -> dict:
        return asdict(self) | {"prompt_lens": list(self.prompt_lens)}

    def differences(self, saved: dict) -> list[str]:
        """What differs between this set and a saved one's `request_set`, as 'NAME there, here'."""
        here = self.to_json()
        named = ("seed", "requests", "max_tokens", "vocab_size")
        found = [f"{key} {saved.get(key)} there, {here[key]} here"
                 for key in named if saved.get(key) != here[key]]
        if not found and (saved.get("prompt_lens") != here["prompt_lens"]
                          or saved.get("target_prompt_len") != here["target_prompt_len"]
                          or saved.get("prompts_sha256") != here["prompts_sha256"]):
            found.append("the prompts differ (another --max-model-len or model length?)")
        return found


def save_tokens(path: str, model: str, request_set: RequestSet, server: dict, run_a: list[Generation],
                seeded_sampling: dict, seeded: list[tuple[int, Generation]]) -> None:
    data = {
        "version": TOKENS_FILE_VERSION, "model": model, "request_set": request_set.to_json(),
        "server": server,
        "run_a": [{"tokens": g.tokens, "finished": g.finished} for g in run_a],
        "seeded": {"sampling": seeded_sampling,
                   "batches": [{"batch_size": size, "tokens": g.tokens, "finished": g.finished}
                               for size, g in seeded]},
    }
    pathlib.Path(path).write_text(json.dumps(data) + "\n")


class TokensFileError(ValueError):
    """A --compare-tokens file that cannot be read, or was made with another request set."""


def load_tokens(path: str, request_set: RequestSet) -> dict:
    """The saved file, checked to hold the same request set as `request_set`."""
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as err:
        raise TokensFileError(f"--compare-tokens {path}: cannot read it: {err}") from err
    if not isinstance(data, dict) or data.get("version") != TOKENS_FILE_VERSION:
        raise TokensFileError(f"--compare-tokens {path}: not a version-{TOKENS_FILE_VERSION} tokens file "
                              "of bench repeat --save-tokens")
    if differences := request_set.differences(data.get("request_set") or {}):
        raise TokensFileError(f"--compare-tokens {path} was made with another request set: "
                              + "; ".join(differences))
    return data


def compare_with_saved(path: str, saved: dict, run_a: list[Generation],
                       seeded: list[tuple[int, Generation]]) -> dict:
    """Run A here against run A there, and the seeded target here against there per batch size
    (sizes the file lacks are marked so)."""
    there_a = [Generation(r["tokens"], r["finished"]) for r in saved["run_a"]]
    there_seeded = {b["batch_size"]: Generation(b["tokens"], b["finished"])
                    for b in saved["seeded"]["batches"]}
    batches = []
    for size, here in seeded:
        there = there_seeded.get(size)
        if there is None:
            batches.append({"batch_size": size, "in_reference": False})
            continue
        batches.append({"batch_size": size, "in_reference": True, "equal": same_tokens(here, there),
                        "common_prefix": common_prefix(here.tokens, there.tokens),
                        "num_tokens": len(here.tokens), "num_tokens_reference": len(there.tokens)})
    return {"file": path, "model": saved["model"], "server": saved["server"],
            "a_vs_reference": agreement(there_a, run_a), "seeded": batches}


def describe_seeded_vs_reference(batch: dict) -> str:
    if not batch["in_reference"]:
        return "not in the reference"
    if batch["equal"]:
        return "equal to the reference"
    return f"differs from the reference at token {batch['common_prefix']}"
