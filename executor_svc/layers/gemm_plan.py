"""Which GEMM each projection of a CUDA graph runs, measured on this GPU (`PAGEDSERVE_GEMM_PLAN`).

A graph records one kernel per projection and bucket, so the choice is made once, while the graphs
warm up. The fixed rule (`linear._graph_backend`: the skinny Triton kernel where kernels.skinny_usable
takes the product, else cuBLAS) was tuned on an H100; on an H200 it loses in places (llama3-8b,
16 layers' weights in one graph, µs a call, docs/benchmarks.md round 20: gate_up + SiLU at 96 rows
78.2 skinny against 67.3 cuBLAS; o_proj and down_proj at 96 rows 13.3 / 33.1 cuBLASLt against 15.6 /
39.1 cuBLAS; qkv at 288 rows 24.5 against 28.1). So for each product the graphs ask for, keyed by
(weight rows, columns, dtype, gated, rows), the candidates (`candidates`: the rule's choice; the
skinny kernel's split-K form where it takes the product, `kernels.skinny_usable(split_k=True)`;
cuBLAS; cuBLASLt through `kernels.blas_library`; from ALGO_MIN_ROWS rows "cublaslt_algo", the fastest
of the first ALGOS algorithms cuBLASLt's heuristic lists for the product, run through
kernels/cublaslt.py: torch runs only the first, and another was 3-22 % faster for o_proj, down,
gate_up and qkv at 128-288 rows on an H200, docs/benchmarks.md round 22) are timed as one CUDA graph
holding one call per layer's own weight of that shape (the weights stream from memory, as in a step),
the median of REPLAYS replays, and another candidate replaces the rule's only when it is MARGIN
faster (`choose`: near-ties keep today's kernel, and of two candidates within MARGIN of each other
the earlier in BACKENDS order stays); a candidate that cannot run on this GPU is logged and left out.

    PAGEDSERVE_GEMM_PLAN unset or "measure"  measure at start-up (a few seconds on an 8B model)
    PAGEDSERVE_GEMM_PLAN=off                 the fixed rule
    PAGEDSERVE_GEMM_PLAN=/path/plan.json     load the plan measured and saved there before (on this
                                             GPU model), measure and save it if the file is missing

A plan file makes restarts choose the same kernels (the same bits for the same batch); a measured
plan can differ between starts only where two candidates are within the timer's spread of MARGIN.
A cuBLASLt algorithm is saved as its 64 bytes with cuBLASLt's version; under another version its
entries are measured again, and one that no longer fits its product runs cuBLASLt's own choice.
Deterministic mode ignores the plan (its batch-invariant matmul serves every product). CPU tensors
never consult it.

How we know it works: tests/unit/test_gemm_plan.py (the choice against fake timings, the margin and
the order, one measurement per product, a failing candidate, the file's round trip and refusals, the
environment), tests/gpu/test_gemm_plan_gpu.py (each backend's product against fp32; a measured plan
saved and read back; graphs with it, or with cuBLASLt everywhere, give the eager logits), and
`clients.bench.ab` over `clients.bench.step` with the plan off and on: a decode graph must not be
slower anywhere and faster where the plan departs from the rule. Measured on an H200 (round 20):
decode graphs of 96 sequences 0.918 of the rule's time, none slower; the 8B offline run +3.1 %
output tokens/s, paired in one call.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PLAN_ENV = "PAGEDSERVE_GEMM_PLAN"
SEARCH_ENV = "PAGEDSERVE_GEMM_SEARCH"  # "listed" (default) or "wide": which cuBLASLt algorithms are timed
WIDE_ALGOS = 400  # "wide": the listed algorithms and up to this many of their variants (LtMatmul.variants)
SCREEN_ABOVE = 16  # more algorithms than this: screened (screen_times_us) first, the SCREEN_KEEP best timed
SCREEN_KEEP = 8
BACKENDS = ("skinny", "skinny_split", "cublas", "cublaslt", "cublaslt_algo")
MARGIN = 0.03  # another candidate must be this much faster than the rule's choice
REPLAYS = 7
PROGRESS_S = 15.0  # while a wide search measures, a progress line at most this often (it takes minutes)
MAX_LAYERS = 8  # weights of one shape in a timing graph (more than any GPU's L2 holds of the large ones)
MAX_ROWS = 512  # larger products (prompt chunks) keep the rule: not measured (less temporary memory)
# cuBLASLt's listed algorithms ("cublaslt_algo") are timed from this many rows: below, the skinny kernel
# or the library's first choice was as fast in every projection of llama3-8b on an H200 (round 22)
ALGO_MIN_ROWS = 65
ALGOS = 8  # of cuBLASLt's list, the first this many are timed (the fastest was among them at 96-512 rows)
FORMAT = 1


@dataclass(frozen=True, slots=True)
class GemmKey:
    """One product a graph asks for: x [rows, k] @ weight [n, k].T, or gated (weight = gate | up,
    SiLU-and-mul after it)."""

    n: int
    k: int
    rows: int
    gated: bool
    dtype: str

    @classmethod
    def of(cls, rows: int, weight: torch.Tensor, gated: bool) -> GemmKey:
        return cls(int(weight.shape[0]), int(weight.shape[1]), int(rows), bool(gated), str(weight.dtype))


def choose(rule: str, times_us: dict[str, float], margin: float = MARGIN) -> str:
    """The rule's choice, replaced by each other candidate in BACKENDS order that is `margin` faster
    than the choice so far: two candidates within the margin of each other never swap on noise."""
    if rule not in times_us:
        raise ValueError(f"the rule's choice {rule!r} was not timed: {sorted(times_us)}")
    chosen = rule
    for backend in BACKENDS:
        if backend in times_us and times_us[backend] < times_us[chosen] * (1 - margin):
            chosen = backend
    return chosen


def candidates(rule: str, split: bool, tuned: bool = False) -> tuple[str, ...]:
    """The backends timed for a product whose fixed rule is `rule`: the skinny kernel only where the
    rule takes it (kernels.skinny_usable), its split-K form where `split` (the caller's
    kernels.skinny_usable(split_k=True)), the libraries, and where `tuned` cuBLASLt's listed
    algorithms (kernels/cublaslt.py), the fastest of which stands for "cublaslt_algo"."""
    skinny = ("skinny",) if rule == "skinny" else ()
    tuned_lt = ("cublaslt_algo",) if tuned else ()
    return skinny + (("skinny_split",) if split else ()) + ("cublas", "cublaslt") + tuned_lt


def graph_time_us(calls: list[Callable[[], object]], replays: int = REPLAYS) -> float:
    """Median GPU time per call (µs) of one CUDA graph holding every call (kernels.bench_common,
    imported here: CPU-only processes never import triton)."""
    from kernels.bench_common import graph_call_us

    return graph_call_us(calls, replays)


def screen_times_us(call_sets: list[list[Callable[[], object]]]) -> list[float]:
    """Per set of calls, its GPU time per call queued without a graph (kernels.bench_common
    queued_call_us; inf for a set that fails): the wide search's first pass."""
    from kernels.bench_common import queued_call_us

    return queued_call_us(call_sets)


class GemmPlan:
    """The measured choices (GemmKey -> backend) and, while measuring, the model's weights by shape.

    `backend(rows, weight, gated, rule, run)` is what `linear` asks: the planned backend of the
    product, measuring it first when the plan measures and the stream is not capturing; `run(backend)`
    computes the product with a backend (the plan times it through that function)."""

    def __init__(self, choices: dict[GemmKey, str] | None = None, measure: bool = True,
                 device_name: str = "", save_to: Path | None = None, algos: dict[GemmKey, str] | None = None,
                 lt_version: int | None = None, wide: bool = False):
        self.choices: dict[GemmKey, str] = dict(choices or {})
        self.wide = wide  # time the variants of cuBLASLt's listed algorithms too (SEARCH_ENV "wide")
        # "cublaslt_algo" choices: the algorithm (kernels.cublaslt.Algo.hex()), valid for cuBLASLt lt_version
        self.algos: dict[GemmKey, str] = dict(algos or {})
        self.lt_version = lt_version
        self.times_us: dict[GemmKey, dict[str, float]] = {}
        self.rules: dict[GemmKey, str] = {}  # the fixed rule's choice of each measured product
        self.measure_s = 0.0  # time spent measuring
        self.measure = measure
        self.device_name = device_name
        self.save_to = save_to
        self._weights: dict[tuple, list[torch.Tensor]] = {}
        self._progress_at = time.monotonic()

    # ---- start-up ----

    @classmethod
    def from_env(cls, device: torch.device) -> GemmPlan | None:
        """The plan PAGEDSERVE_GEMM_PLAN asks for (module docstring), or None for the fixed rule."""
        value = os.environ.get(PLAN_ENV, "measure").strip()
        if value.lower() == "off":
            return None
        search = os.environ.get(SEARCH_ENV, "listed").strip().lower() or "listed"
        if search not in ("listed", "wide"):
            raise ValueError(f"{SEARCH_ENV}={search!r}: expected 'listed' or 'wide'")
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        version = None  # None: cuBLASLt's algorithms are not offered (no binding to call them through)
        if device.type == "cuda":
            from kernels import cublaslt

            try:
                version = cublaslt.version()
            except (OSError, AttributeError, RuntimeError) as exc:
                log.warning("GEMM plan: cuBLASLt cannot be called here (%s: %s); its listed algorithms are "
                            "not timed", type(exc).__name__, exc)
        if value.lower() in ("", "measure"):
            plan = cls(device_name=name, lt_version=version)
        elif Path(value).exists():
            plan = cls.load(Path(value), name, version)
        else:
            plan = cls(device_name=name, save_to=Path(value), lt_version=version)
        plan.wide = search == "wide"
        if plan.wide and plan.measure and not plan.choices:  # a fresh measurement, not a file's
            log.info("GEMM plan: the wide search times up to %d cuBLASLt algorithms a product from %d rows: "
                     "minutes at start-up (~140 s for llama3-8b on an H200)%s", WIDE_ALGOS, ALGO_MIN_ROWS,
                     f"; saved to {plan.save_to}" if plan.save_to else
                     ", every start: save it once with PAGEDSERVE_GEMM_PLAN=/path/plan.json")
        return plan

    def register(self, weights: Iterable[torch.Tensor]) -> None:
        """The model's projection weights, grouped by shape, to time a product over every layer's own."""
        for w in weights:
            if w.dim() == 2:
                group = self._weights.setdefault((tuple(w.shape), w.dtype, w.device), [])
                if len(group) < MAX_LAYERS and all(w.data_ptr() != g.data_ptr() for g in group):
                    group.append(w)

    # ---- what linear asks ----

    def backend(self, rows: int, weight: torch.Tensor, gated: bool, rule: str,
                run: Callable[..., Callable[[], object]], split: bool = False,
                algos: Callable[[], list[str]] | None = None) -> str:
        """The backend for this product. `run(backend, w, algo=None)` gives a call that computes the
        product with `backend` over weight w (as the layer does), for timing; `split`: the skinny
        kernel's split-K form takes the product; `algos()`: cuBLASLt's listed algorithms for it (None:
        "cublaslt_algo" is not offered), timed from ALGO_MIN_ROWS rows. A "cublaslt_algo" choice's
        algorithm is `algo(...)`'s."""
        key = GemmKey.of(rows, weight, gated)
        tuned = algos is not None and rows >= ALGO_MIN_ROWS
        chosen = self.choices.get(key)
        if chosen is not None and (chosen not in candidates(rule, split, tuned)
                                   or (chosen == "cublaslt_algo" and key not in self.algos)):
            log.warning("GEMM plan: %s cannot take %s here; the fixed rule's %s instead", chosen, key, rule)
            return rule
        if chosen is not None:
            return chosen
        if not self.measure or rows > MAX_ROWS or torch.cuda.is_current_stream_capturing():
            return rule
        begin = time.perf_counter()
        group = self._weights.get((tuple(weight.shape), weight.dtype, weight.device)) or [weight]
        times = {rule: graph_time_us([run(rule, w) for w in group])}  # the rule's failure is the graphs'
        for backend in (b for b in candidates(rule, split, tuned) if b != rule):
            try:
                if backend == "cublaslt_algo":
                    times[backend], self.algos[key] = self._fastest_algo(group, run, algos())
                else:
                    times[backend] = graph_time_us([run(backend, w) for w in group])
            except Exception as exc:  # noqa: BLE001 - a candidate that cannot run here is not chosen
                log.warning("GEMM plan: %s cannot run %s here (%s: %s); not a candidate", backend, key,
                            type(exc).__name__, exc)
        self.measure_s += time.perf_counter() - begin
        self.times_us[key], self.rules[key] = times, rule
        if self.wide and time.monotonic() - self._progress_at >= PROGRESS_S:
            self._progress_at = time.monotonic()
            log.info("GEMM plan (the wide search): products measured so far %d, in %.0f s", len(self.rules),
                     self.measure_s)
        self.choices[key] = choose(rule, times)
        if self.choices[key] != "cublaslt_algo":
            self.algos.pop(key, None)
        if self.choices[key] != rule:
            log.debug("GEMM plan: %s takes %s (%s µs) instead of %s (%s µs)", key, self.choices[key],
                     round(times[self.choices[key]], 2), rule, round(times[rule], 2))
        return self.choices[key]

    @staticmethod
    def _fastest_algo(group: list[torch.Tensor], run, listed: list[str]) -> tuple[float, str]:
        """(µs, algorithm) of the fastest of the given cuBLASLt algorithms; ValueError if none ran. More
        than SCREEN_ABOVE (a wide search): all screened first (`screen_times_us`: queued, without a
        graph each), then the SCREEN_KEEP fastest each in its graph with REPLAYS."""

        def timed(algos: list[str], replays: int) -> list[tuple[float, str]]:
            results = []
            for algo in algos:
                try:
                    results.append((graph_time_us([run("cublaslt_algo", w, algo) for w in group], replays),
                                    algo))
                except Exception as exc:  # noqa: BLE001 - one algorithm that fails is skipped
                    log.debug("GEMM plan: cuBLASLt algorithm %s failed (%s)", algo, exc)
            return results

        if len(listed) > SCREEN_ABOVE:
            sets = [[run("cublaslt_algo", w, algo) for w in group] for algo in listed]
            screened = sorted((us, algo) for us, algo in zip(screen_times_us(sets), listed, strict=True)
                              if math.isfinite(us))
            listed = [algo for _, algo in screened[:SCREEN_KEEP]]
        results = timed(listed, REPLAYS)
        if not results:
            raise ValueError(f"none of the {len(listed)} cuBLASLt algorithms ran")
        return min(results, key=lambda r: r[0])

    def algo(self, rows: int, weight: torch.Tensor, gated: bool) -> str | None:
        """The cuBLASLt algorithm of a "cublaslt_algo" choice (None for any other)."""
        return self.algos.get(GemmKey.of(rows, weight, gated))

    def departures(self) -> dict[GemmKey, str]:
        """The measured products whose backend is not the rule's."""
        return {k: b for k, b in self.choices.items() if k in self.rules and b != self.rules[k]}

    def summary(self) -> str:
        gone = self.departures()
        parts = ", ".join(f"{k.n}x{k.k}{' gated' if k.gated else ''} at {k.rows} rows: {b}"
                          for k, b in sorted(gone.items(), key=lambda kv: (kv[0].n, kv[0].rows)))
        return (f"GEMM plan ({self.device_name}): {len(self.rules)} products measured in "
                f"{self.measure_s:.1f} s, {len(gone)} take another backend than the fixed rule"
                + (f" ({parts})" if parts else ""))

    def finish(self) -> None:
        """After a capture: log what was measured, save the file when there is one."""
        if self.rules:
            log.info(self.summary())
            self.save()

    # ---- the file ----

    def to_json(self) -> dict:
        entries = []
        order = sorted(self.choices.items(), key=lambda kv: (kv[0].n, kv[0].k, kv[0].gated, kv[0].rows))
        for key, backend in order:
            entry = {"n": key.n, "k": key.k, "rows": key.rows, "gated": key.gated, "dtype": key.dtype,
                     "backend": backend}
            if backend == "cublaslt_algo":
                entry["algo"] = self.algos[key]
            if key in self.times_us:
                entry["rule"] = self.rules[key]
                entry["us"] = {b: round(t, 3) for b, t in self.times_us[key].items()}
            entries.append(entry)
        return {"format": FORMAT, "device": self.device_name, "margin": MARGIN, "cublaslt": self.lt_version,
                "choices": entries}

    def save(self) -> None:
        """Writes the plan to `save_to` (if any); ValueError naming the path where it cannot."""
        path = self.save_to
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # a file of this process's own, then renamed: ranks saving to one path never interleave
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.to_json(), indent=1))
            tmp.replace(path)
        except OSError as exc:
            raise ValueError(f"{PLAN_ENV}={path}: cannot write the plan ({exc})") from exc

    @classmethod
    def from_json(cls, doc: dict, device_name: str, where: str = "GEMM plan",
                  lt_version: int | None = None) -> GemmPlan:
        """A saved plan (measuring what it lacks). ValueError naming the problem for another format,
        another GPU model or a malformed entry. Entries naming a cuBLASLt algorithm saved under another
        cuBLASLt version than `lt_version` are dropped (measured again), with a warning."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"{where}: not a GEMM plan of format {FORMAT}")
        if doc.get("device") != device_name:
            raise ValueError(f"{where}: measured on {doc.get('device')!r}, this GPU is {device_name!r}; "
                             f"delete it or point {PLAN_ENV} elsewhere to measure again")
        choices, algos, stale = {}, {}, 0
        same_lt = doc.get("cublaslt") == lt_version
        for i, e in enumerate(doc.get("choices", [])):
            try:
                key = GemmKey(int(e["n"]), int(e["k"]), int(e["rows"]), bool(e["gated"]), str(e["dtype"]))
                backend = e["backend"]
                algo = str(e["algo"]) if backend == "cublaslt_algo" else None
                if algo is not None and len(bytes.fromhex(algo)) != 64:
                    raise ValueError(f"algo is {len(bytes.fromhex(algo))} bytes, not 64")
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{where}: entry {i} is malformed ({exc!r})") from exc
            if backend not in BACKENDS or min(key.n, key.k, key.rows) < 1:
                raise ValueError(f"{where}: entry {i} has backend {backend!r} / sizes {key}")
            if algo is not None and not same_lt:
                stale += 1
                continue
            choices[key] = backend
            if algo is not None:
                algos[key] = algo
        if stale:
            log.warning("%s: %d cuBLASLt algorithms were saved under cuBLASLt %s, this is %s; measuring "
                        "those products again", where, stale, doc.get("cublaslt"), lt_version)
        return cls(choices, device_name=device_name, algos=algos, lt_version=lt_version)

    @classmethod
    def load(cls, path: Path, device_name: str, lt_version: int | None = None) -> GemmPlan:
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{PLAN_ENV}={path}: cannot read the plan ({exc})") from exc
        plan = cls.from_json(doc, device_name, f"{PLAN_ENV}={path}", lt_version)
        plan.save_to = path  # products it lacks are measured and the file rewritten
        return plan
