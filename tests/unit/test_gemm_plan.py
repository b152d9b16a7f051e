"""The GEMM plan (executor_svc/layers/gemm_plan.py) without a GPU: the choice against given timings
and its margin, measuring each product once over the layers' weights of its shape, what is never
measured, the file's round trip and its refusals, and PAGEDSERVE_GEMM_PLAN. The timings themselves
and the backends' results are checked on the GPU (tests/gpu/test_gemm_plan_gpu.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from executor_svc.layers import gemm_plan
from executor_svc.layers.gemm_plan import GemmKey, GemmPlan, choose


def test_choose_keeps_the_rule_within_the_margin():
    assert choose("skinny", {"skinny": 10.0, "cublas": 9.8, "cublaslt": 9.9}) == "skinny"  # 2 % faster
    assert choose("skinny", {"skinny": 10.0, "cublas": 9.0, "cublaslt": 9.5}) == "cublas"
    assert choose("cublas", {"cublas": 20.0, "cublaslt": 17.0}) == "cublaslt"
    assert choose("cublas", {"cublas": 20.0, "cublaslt": 21.0}) == "cublas"
    assert choose("cublas", {"cublas": 20.0, "cublaslt": 19.0}, margin=0.1) == "cublas"
    # two candidates within the margin of each other: the earlier in BACKENDS order, not the noise's pick
    assert choose("skinny", {"skinny": 17.5, "cublas": 16.70, "cublaslt": 16.62}) == "cublas"
    assert choose("skinny", {"skinny": 17.5, "cublas": 16.62, "cublaslt": 16.70}) == "cublas"
    assert choose("skinny", {"skinny": 17.5, "cublas": 16.70, "cublaslt": 15.0}) == "cublaslt"
    # the split-K form: 5 % faster than the skinny kernel, and cuBLAS within the margin of it
    assert choose("skinny", {"skinny": 10.0, "skinny_split": 9.5, "cublas": 9.6}) == "skinny_split"
    with pytest.raises(ValueError, match="rule's choice 'skinny' was not timed"):
        choose("skinny", {"cublas": 1.0})


@pytest.fixture
def fake_timer(monkeypatch):
    """graph_time_us from a table of per-backend times; records what it was asked to time."""
    timed = []
    table = {}

    def fake(calls, replays=gemm_plan.REPLAYS):
        results = [call() for call in calls]
        backend = results[0][0]
        timed.append((backend, [w for _, w in results]))
        value = table[backend]
        return value(replays) if callable(value) else value

    monkeypatch.setattr(gemm_plan, "graph_time_us", fake)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return timed, table


def _run(backend, w, algo=None):
    return lambda: (backend if algo is None else f"{backend}:{algo[:2]}", w)


A1, A2, A3 = "a1" * 64, "a2" * 64, "a3" * 64  # three cuBLASLt algorithms' bytes, as hex


def test_a_product_is_measured_once_over_the_layers_of_its_shape(fake_timer):
    timed, table = fake_timer
    table.update(skinny=12.0, skinny_split=11.0, cublas=10.0, cublaslt=11.0)
    layers = [torch.empty(96, 64) for _ in range(12)]
    other = torch.empty(32, 64)
    plan = GemmPlan(device_name="gpu")
    plan.register([*layers, other, layers[0], torch.empty(5)])  # a repeat and a 1-D tensor are ignored
    assert plan.backend(16, layers[3], False, "skinny", _run, split=True) == "cublas"
    assert [b for b, _ in timed] == ["skinny", "skinny_split", "cublas", "cublaslt"]  # the rule first
    assert all(ws == layers[: gemm_plan.MAX_LAYERS] for _, ws in timed)  # distinct weights of its shape
    assert plan.backend(16, layers[5], False, "skinny", _run, split=True) == "cublas"  # not again
    assert len(timed) == 4
    assert plan.backend(16, other, False, "cublas", _run) == "cublas"  # another shape: measured
    assert timed[-1][1] == [other] and len(timed) == 6  # no skinny candidate where the rule is cuBLAS
    assert plan.backend(16, layers[0], True, "skinny", _run) == "cublas"  # gated is another product
    assert [b for b, _ in timed[6:]] == ["skinny", "cublas", "cublaslt"]  # without split: not timed
    key = GemmKey.of(16, layers[0], False)
    assert plan.departures() == {key: "cublas", GemmKey.of(16, layers[0], True): "cublas"}
    assert plan.times_us[key] == {"skinny": 12.0, "skinny_split": 11.0, "cublas": 10.0, "cublaslt": 11.0}
    assert "2 take another backend" in plan.summary() and "96x64 at 16 rows: cublas" in plan.summary()


def test_a_candidate_that_fails_is_not_chosen_and_the_rule_failing_is_an_error(fake_timer):
    timed, table = fake_timer
    table.update(skinny=10.0, cublas=5.0)  # no cublaslt entry: timing it raises KeyError
    plan = GemmPlan()
    w = torch.empty(8, 8)
    assert plan.backend(4, w, False, "skinny", _run) == "cublas"
    assert set(plan.times_us[GemmKey.of(4, w, False)]) == {"skinny", "cublas"}
    table.pop("skinny")
    with pytest.raises(KeyError):
        plan.backend(5, w, False, "skinny", _run)


def test_a_file_naming_the_skinny_kernel_where_it_cannot_run_gets_the_rule(fake_timer):
    timed, table = fake_timer
    w = torch.empty(8, 8)
    plan = GemmPlan({GemmKey.of(300, w, False): "skinny", GemmKey.of(4, w, False): "skinny",
                     GemmKey.of(200, w, False): "skinny_split", GemmKey.of(4, w, True): "skinny_split",
                     GemmKey.of(5, w, False): "skinny_split", GemmKey.of(6, w, False): "skinny_split"})
    assert plan.backend(300, w, False, "cublas", _run) == "cublas"  # skinny refused there: the rule
    assert plan.backend(200, w, False, "cublas", _run) == "cublas"
    assert plan.backend(4, w, True, "skinny", _run) == "skinny"  # no split-K form of a gated product
    assert plan.backend(4, w, False, "skinny", _run) == "skinny"
    assert plan.backend(5, w, False, "skinny", _run, split=True) == "skinny_split"
    assert plan.backend(6, w, False, "skinny", _run) == "skinny"  # the split form cannot take it here
    assert timed == []  # neither measured


def test_what_is_never_measured(fake_timer, monkeypatch):
    timed, table = fake_timer
    table.update(cublas=10.0, cublaslt=1.0)
    w = torch.empty(8, 8)
    assert GemmPlan(measure=False).backend(4, w, False, "cublas", _run) == "cublas"
    assert GemmPlan().backend(gemm_plan.MAX_ROWS + 1, w, False, "cublas", _run) == "cublas"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert GemmPlan().backend(4, w, False, "cublas", _run) == "cublas"  # inside a capture: the rule
    assert timed == []


def test_the_file_round_trip(tmp_path, fake_timer):
    timed, table = fake_timer
    table.update(skinny=5.0, skinny_split=4.2, cublas=4.0, cublaslt=4.5)
    plan = GemmPlan(device_name="NVIDIA H200", save_to=tmp_path / "sub" / "plan.json")
    w = torch.empty(64, 32, dtype=torch.bfloat16)
    plan.backend(8, w, False, "skinny", _run, split=True)
    plan.backend(8, w, True, "skinny", _run)
    plan.finish()
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["plan.json"]  # no temporary left
    doc = json.loads((tmp_path / "sub" / "plan.json").read_text())
    assert doc["device"] == "NVIDIA H200" and len(doc["choices"]) == 2
    assert doc["choices"][0] == {"n": 64, "k": 32, "rows": 8, "gated": False, "dtype": "torch.bfloat16",
                                 "backend": "cublas", "rule": "skinny",
                                 "us": {"skinny": 5.0, "skinny_split": 4.2, "cublas": 4.0, "cublaslt": 4.5}}
    again = GemmPlan.load(tmp_path / "sub" / "plan.json", "NVIDIA H200")
    assert again.choices == plan.choices and again.save_to == tmp_path / "sub" / "plan.json"
    count = len(timed)
    assert again.backend(8, w, False, "skinny", _run, split=True) == "cublas" and len(timed) == count


def test_cublaslt_algorithms_are_timed_from_algo_min_rows_and_the_fastest_kept(fake_timer):
    timed, table = fake_timer
    table.update({"cublas": 10.0, "cublaslt": 10.0, "cublaslt_algo:a1": 9.9, "cublaslt_algo:a2": 8.0})
    listed = []

    def algos():
        listed.append(1)
        return [A1, A2, A3]  # A3 has no time: it fails and is skipped

    w = torch.empty(8, 8)
    plan = GemmPlan(device_name="g", lt_version=7)
    small = gemm_plan.ALGO_MIN_ROWS - 1
    assert plan.backend(small, w, False, "cublas", _run, algos=algos) == "cublas"
    assert listed == [] and "cublaslt_algo" not in plan.times_us[GemmKey.of(small, w, False)]
    rows = gemm_plan.ALGO_MIN_ROWS
    assert plan.backend(rows, w, False, "cublas", _run, algos=algos) == "cublaslt_algo"
    assert plan.algo(rows, w, False) == A2 and plan.algo(small, w, False) is None
    assert plan.times_us[GemmKey.of(rows, w, False)]["cublaslt_algo"] == 8.0
    assert [b for b, _ in timed[-3:]] == ["cublaslt_algo:a1", "cublaslt_algo:a2", "cublaslt_algo:a3"]
    assert plan.backend(rows, w, False, "cublas", _run, algos=algos) == "cublaslt_algo" and len(listed) == 1
    assert plan.backend(rows, w, False, "cublas", _run) == "cublas"  # not offered here: the rule
    # the fastest algorithm within the margin of cuBLAS: the rule stays, no algorithm kept
    table["cublaslt_algo:a2"] = 9.8
    assert plan.backend(rows + 1, w, False, "cublas", _run, algos=algos) == "cublas"
    assert plan.algo(rows + 1, w, False) is None
    # none of the listed algorithms runs: not a candidate
    assert plan.backend(rows + 2, w, False, "cublas", _run, algos=lambda: [A3]) == "cublas"
    assert set(plan.times_us[GemmKey.of(rows + 2, w, False)]) == {"cublas", "cublaslt"}


def test_a_wide_search_screens_its_algorithms_then_times_the_best_again(fake_timer, monkeypatch):
    timed, table = fake_timer
    table.update({"cublas": 10.0, "cublaslt": 10.0})
    algos = [f"{i:02x}" * 64 for i in range(40)]  # 40 algorithms: more than SCREEN_ABOVE
    screened = []

    def screen(call_sets):  # the queued pass ranks algorithm 30 first, 31 second; 7 fails
        screened.append([[call() for call in calls] for calls in call_sets])
        times = [{30: 5.0, 31: 5.5}.get(i, 6.0 + i / 100) for i in range(len(call_sets))]
        times[7] = math.inf
        return times

    monkeypatch.setattr(gemm_plan, "screen_times_us", screen)
    for i in range(40):  # the graphs' timing: 31 is the fastest
        table[f"cublaslt_algo:{i:02x}"] = {30: 5.2, 31: 4.9}.get(i, 6.0)
    w, w2 = torch.empty(8, 8), torch.empty(8, 8)
    plan = GemmPlan(wide=True)
    plan.register([w, w2])
    assert plan.backend(128, w, False, "cublas", _run, algos=lambda: algos) == "cublaslt_algo"
    assert plan.algo(128, w, False) == algos[31]
    (sets,) = screened  # one screen over every algorithm, each set one call per layer's weight
    assert [[backend for backend, _ in calls] for calls in sets] == [[f"cublaslt_algo:{i:02x}"] * 2
                                                                      for i in range(40)]
    assert all(calls[0][1] is w and calls[1][1] is w2 for calls in sets)
    algo_timings = [b for b, _ in timed if b.startswith("cublaslt_algo")]
    # only the best SCREEN_KEEP of the screen get a graph (7, failed there, is not among them)
    assert sorted(algo_timings) == sorted(f"cublaslt_algo:{i:02x}" for i in (30, 31, 0, 1, 2, 3, 4, 5))


def test_a_wide_search_says_it_takes_minutes_and_how_far_it_is(fake_timer, monkeypatch, tmp_path, caplog):
    timed, table = fake_timer
    table.update(cublas=10.0, cublaslt=10.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "gpu")
    monkeypatch.setenv(gemm_plan.SEARCH_ENV, "wide")
    monkeypatch.setenv(gemm_plan.PLAN_ENV, str(tmp_path / "plan.json"))
    with caplog.at_level("INFO", logger=gemm_plan.log.name):
        plan = GemmPlan.from_env(torch.device("cpu"))
    assert "the wide search times up to 400 cuBLASLt algorithms" in caplog.text
    assert f"saved to {tmp_path / 'plan.json'}" in caplog.text
    monkeypatch.setattr(gemm_plan, "PROGRESS_S", 0.0)
    caplog.clear()
    with caplog.at_level("INFO", logger=gemm_plan.log.name):
        for rows in (1, 2):
            plan.backend(rows, torch.empty(8, 8), False, "cublas", _run)
    assert "products measured so far 1, in" in caplog.text and "products measured so far 2, in" in caplog.text
    listed = GemmPlan()  # the listed search says nothing while it measures (seconds)
    caplog.clear()
    with caplog.at_level("INFO", logger=gemm_plan.log.name):
        listed.backend(3, torch.empty(8, 8), False, "cublas", _run)
    assert "so far" not in caplog.text


def test_the_search_environment(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv(gemm_plan.PLAN_ENV, "measure")
    assert GemmPlan.from_env(cpu).wide is False  # "listed" by default
    monkeypatch.setenv(gemm_plan.SEARCH_ENV, "Wide")
    assert GemmPlan.from_env(cpu).wide is True
    monkeypatch.setenv(gemm_plan.SEARCH_ENV, "everything")
    with pytest.raises(ValueError, match="PAGEDSERVE_GEMM_SEARCH='everything': expected 'listed' or 'wide'"):
        GemmPlan.from_env(cpu)
    monkeypatch.setenv(gemm_plan.PLAN_ENV, "off")  # no plan: the search is not read
    assert GemmPlan.from_env(cpu) is None


def test_a_process_that_cannot_call_cublaslt_still_gets_a_plan(monkeypatch, caplog):
    import sys
    import types

    fake = types.ModuleType("kernels.cublaslt")

    def missing():
        raise OSError("libcublasLt.so: cannot open shared object file")

    fake.version = missing
    monkeypatch.setitem(sys.modules, "kernels.cublaslt", fake)
    import kernels

    monkeypatch.setattr(kernels, "cublaslt", fake, raising=False)  # also where it was imported before
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setenv(gemm_plan.PLAN_ENV, "measure")
    plan = GemmPlan.from_env(torch.device("cuda", 0))
    assert plan is not None and plan.lt_version is None  # linear offers no cuBLASLt algorithm then
    assert "cuBLASLt cannot be called here (OSError" in caplog.text


def test_a_saved_cublaslt_algorithm_is_kept_for_its_cublaslt_version_only(tmp_path, fake_timer):
    timed, table = fake_timer
    table.update({"cublas": 10.0, "cublaslt": 10.0, "cublaslt_algo:a1": 5.0})
    w = torch.empty(16, 8, dtype=torch.bfloat16)
    path = tmp_path / "plan.json"
    plan = GemmPlan(device_name="g", save_to=path, lt_version=130100)
    assert plan.backend(128, w, True, "cublas", _run, algos=lambda: [A1]) == "cublaslt_algo"
    plan.finish()
    doc = json.loads(path.read_text())
    assert doc["cublaslt"] == 130100 and doc["choices"][0]["algo"] == A1
    count = len(timed)
    again = GemmPlan.load(path, "g", 130100)
    assert again.backend(128, w, True, "cublas", _run, algos=lambda: [A1]) == "cublaslt_algo"
    assert again.algo(128, w, True) == A1 and len(timed) == count  # read, not measured
    other = GemmPlan.load(path, "g", 130200)  # another cuBLASLt: its algorithms may not exist there
    assert other.choices == {} and other.algos == {}
    assert other.backend(128, w, True, "cublas", _run, algos=lambda: [A1]) == "cublaslt_algo"
    assert len(timed) > count  # measured again
    # an entry naming an algorithm, read where algorithms are not offered: the rule
    assert again.backend(128, w, True, "cublas", _run) == "cublas"


@pytest.mark.parametrize("doc, message", [
    ({"format": 1, "device": "g", "choices": [{"n": 1, "k": 1, "rows": 1, "gated": False, "dtype": "x",
                                               "backend": "cublaslt_algo"}]}, "entry 0 is malformed"),
    ({"format": 1, "device": "g", "choices": [{"n": 1, "k": 1, "rows": 1, "gated": False, "dtype": "x",
                                               "backend": "cublaslt_algo", "algo": "zz"}]}, "malformed"),
    ({"format": 1, "device": "g", "choices": [{"n": 1, "k": 1, "rows": 1, "gated": False, "dtype": "x",
                                               "backend": "cublaslt_algo", "algo": "00" * 8}]}, "8 bytes"),
])
def test_a_bad_cublaslt_algorithm_is_refused(doc, message):
    with pytest.raises(ValueError, match=message):
        GemmPlan.from_json(doc, "g")


@pytest.mark.parametrize("doc, message", [
    ({"format": 2, "device": "g", "choices": []}, "not a GEMM plan of format 1"),
    ([], "not a GEMM plan"),
    ({"format": 1, "device": "NVIDIA H100", "choices": []}, "measured on 'NVIDIA H100', this GPU is 'g'"),
    ({"format": 1, "device": "g", "choices": [{"n": 1}]}, "entry 0 is malformed"),
    ({"format": 1, "device": "g", "choices": [{"n": 1, "k": 1, "rows": 1, "gated": False, "dtype": "x",
                                               "backend": "magic"}]}, "backend 'magic'"),
    ({"format": 1, "device": "g", "choices": [{"n": 1, "k": 1, "rows": -4, "gated": False, "dtype": "x",
                                               "backend": "cublas"}]}, "sizes"),
    ({"format": 1, "device": "g", "choices": [{"n": "many", "k": 1, "rows": 1, "gated": False,
                                               "dtype": "x", "backend": "cublas"}]}, "malformed"),
])
def test_a_bad_file_is_refused_with_its_problem(doc, message):
    with pytest.raises(ValueError, match=message):
        GemmPlan.from_json(doc, "g")


def test_the_environment(tmp_path, monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv(gemm_plan.PLAN_ENV, "off")
    assert GemmPlan.from_env(cpu) is None
    monkeypatch.setenv(gemm_plan.PLAN_ENV, "measure")
    plan = GemmPlan.from_env(cpu)
    assert plan.measure and plan.save_to is None and plan.choices == {}
    monkeypatch.delenv(gemm_plan.PLAN_ENV)
    assert GemmPlan.from_env(cpu).save_to is None  # measure by default
    path = tmp_path / "plan.json"
    monkeypatch.setenv(gemm_plan.PLAN_ENV, str(path))
    assert GemmPlan.from_env(cpu).save_to == path  # missing: measure, then save there
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the plan"):
        GemmPlan.from_env(cpu)
    path.write_text(json.dumps({"format": 1, "device": "cpu", "choices": [
        {"n": 4, "k": 4, "rows": 2, "gated": True, "dtype": "torch.float32", "backend": "cublaslt"}]}))
    assert GemmPlan.from_env(cpu).choices == {GemmKey(4, 4, 2, True, "torch.float32"): "cublaslt"}
    monkeypatch.setenv(gemm_plan.PLAN_ENV, str(tmp_path))  # a directory
    with pytest.raises(ValueError, match="cannot read the plan"):
        GemmPlan.from_env(cpu)
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(ValueError, match="cannot write the plan"):
        GemmPlan(save_to=blocked / "plan.json").save()


def test_projection_weights_are_every_linear_layer_and_the_lm_head():
    from executor_svc.layers.linear import projection_weights
    from executor_svc.layers.mlp import GatedMLP

    mlp = GatedMLP(64, 128, bias=False, tp_rank=0, tp_size=1)
    weights = projection_weights(mlp)
    assert [tuple(w.shape) for w in weights] == [(256, 64), (64, 128)]
