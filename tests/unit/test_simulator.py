"""The simulator's figures (docs/simulator.md) as inequalities, on fewer requests than the docs."""

import json

import pytest

from clients.cli.main import main as cli_main
from scheduler_svc.sim.models import MODELS, StepTimeModel
from scheduler_svc.sim.simulator import GIB, SimConfig, simulate

FIGURE_KEYS = {
    "kv_utilization",
    "avg_running",
    "num_preemptions",
    "num_swapped_blocks",
    "sharing_saving",
    "prefix_hit_rate",
    "throughput_tok_s",
    "normalized_latency_s",
}


def test_model_shapes_and_kv_budget():
    llama2 = MODELS["llama2-13b"]
    assert llama2.kv_bytes_per_token == 2 * 40 * 40 * 128 * 2 == 819200  # 800 KiB, like OPT-13B
    assert llama2.num_gpu_blocks(12 * GIB, 16) == 983
    assert llama2.num_params == pytest.approx(13.0e9, rel=0.02)
    assert MODELS["opt-13b"].num_params == pytest.approx(12.9e9, rel=0.03)
    llama3 = MODELS["llama3-8b"]
    assert llama3.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert llama3.num_gpu_blocks(12 * GIB, 16) == 6144
    assert llama3.num_params == pytest.approx(8.03e9, rel=0.02)


def test_step_time_model_is_memory_bound_for_decode_and_compute_bound_for_prefill():
    model = StepTimeModel(MODELS["llama2-13b"])
    decode_1 = model.step_time_s(1, 100)
    decode_32 = model.step_time_s(32, 32 * 100)
    assert model.step_time_s(0, 0) == 0.0
    assert 0.015 < decode_1 < 0.03  # ~26 GB of weights at ~1.2 TB/s
    assert decode_32 < 1.2 * decode_1  # batching decode is almost free ...
    assert model.step_time_s(2048, 2048) > 5 * decode_1  # ... a long prefill is not


@pytest.fixture(scope="module")
def sharegpt_by_policy():
    policies = ("paged", "reserve-max", "reserve-pow2", "reserve-oracle")
    return {p: simulate(SimConfig(workload="sharegpt", num_requests=250, policy=p)) for p in policies}


def test_paged_utilization_and_the_orca_baselines_in_the_papers_order(sharegpt_by_policy):
    util = {p: r["kv_utilization"] for p, r in sharegpt_by_policy.items()}
    assert util["paged"] >= 0.96
    assert util["reserve-max"] < util["reserve-pow2"] < util["reserve-oracle"] < 0.6 * util["paged"]
    assert 0.1 < util["reserve-max"] < 0.3  # paper Fig. 2: 20.4 %
    for result in sharegpt_by_policy.values():
        assert result["num_finished_requests"] == 250 and result["num_dropped_requests"] == 0
        assert result.keys() >= FIGURE_KEYS


def test_paging_batches_at_least_twice_the_oracles_requests(sharegpt_by_policy):
    running = {p: r["avg_running"] for p, r in sharegpt_by_policy.items()}
    assert running["paged"] >= 2 * running["reserve-oracle"]  # paper Fig. 13a: 2.2x
    assert running["reserve-max"] < running["reserve-pow2"] < running["reserve-oracle"]
    tput = {p: r["throughput_tok_s"] for p, r in sharegpt_by_policy.items()}
    assert tput["paged"] > tput["reserve-oracle"] > tput["reserve-pow2"] > tput["reserve-max"]
    for policy in ("reserve-max", "reserve-pow2", "reserve-oracle"):
        assert sharegpt_by_policy[policy]["num_preemptions"] == 0  # everything is reserved up front
        assert sharegpt_by_policy[policy]["prefix_hit_rate"] == 0.0


def test_prefix_caching_hits_the_shared_prefix_and_raises_throughput():
    cached = simulate(SimConfig(workload="prefix", num_requests=200))
    uncached = simulate(SimConfig(workload="prefix", num_requests=200, enable_prefix_caching=False))
    assert cached["prefix_hit_rate"] > 0.85  # 21 of ~22.6 prompt blocks are the shared prefix
    assert uncached["prefix_hit_rate"] == 0.0
    assert cached["sharing_saving"] > 0.2 and uncached["sharing_saving"] == 0.0
    assert cached["throughput_tok_s"] > 1.3 * uncached["throughput_tok_s"]


def test_sharing_saving_grows_with_parallel_samples_and_more_with_beams():
    common = {"workload": "alpaca", "num_requests": 100, "rate_per_s": 4.0}
    n2 = simulate(SimConfig(n=2, **common))["sharing_saving"]
    n4 = simulate(SimConfig(n=4, **common))["sharing_saving"]
    beam4 = simulate(SimConfig(beam_width=4, **common))["sharing_saving"]
    assert 0.02 < n2 < n4 < 0.2  # paper Fig. 15 (Alpaca, parallel): 6.1 % - 9.8 %
    assert beam4 > 2 * n4
    reserved = simulate(SimConfig(n=4, policy="reserve-oracle", **common))
    assert reserved["sharing_saving"] == 0.0 and reserved["num_finished_requests"] == 100


@pytest.mark.parametrize("sampling", [{"n": 2}, {"beam_width": 3}])
def test_preemption_and_swapping_keep_every_kv_read_correct(sampling):
    result = simulate(
        SimConfig(workload="alpaca", num_requests=60, kv_gib=0.5, swap_gib=0.1, verify_kv=True, **sampling)
    )
    assert result["num_preemptions"] > 0 and result["num_swapped_blocks"] > 0
    assert result["num_swapped_in_blocks"] == result["num_swapped_blocks"]
    assert result["num_finished_requests"] + result["num_dropped_requests"] == 60


def test_cli_prints_one_json_object_and_is_deterministic(capsys):
    argv = ["simulate", "--workload", "alpaca", "--requests", "30", "--policy", "reserve-pow2", "--json"]
    outputs = []
    for _ in range(2):
        assert cli_main(argv) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    for out in outputs:
        del out["wall_time_s"]
    assert outputs[0] == outputs[1]
    figures = outputs[0]
    assert figures.keys() >= FIGURE_KEYS
    assert figures["config"]["policy"] == "reserve-pow2" and figures["config"]["num_requests"] == 30
    assert figures["num_finished_requests"] == 30
    assert cli_main(["simulate", "--workload", "alpaca", "--requests", "5"]) == 0
    assert "kv_utilization" in capsys.readouterr().out


def test_bad_configurations_are_refused(capsys):
    with pytest.raises(ValueError):
        SimConfig(policy="reserve-min")
    with pytest.raises(ValueError):
        SimConfig(policy="reserve-max", preemption_mode="swap")
    with pytest.raises(ValueError):
        SimConfig(n=2, beam_width=2)
    assert cli_main(["simulate", "--requests", "0"]) == 2
    assert "num_requests" in capsys.readouterr().out
