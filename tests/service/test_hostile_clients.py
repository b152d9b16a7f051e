"""Issue 14, the request side, on a real stack (in-process, loopback): no input one client sends can
stop the engine, freeze other streams, hold blocks after it ends, or reach another client's request.
Each test names the defect it pins; the last one is the hostile-client soak in CI size."""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
import threading
import time

import grpc
import pytest

from clients.client import AsyncClient, Client, build_request
from protos.pagedserve.v1 import generation_pb2, generation_pb2_grpc
from scheduler_svc.request.beam import BeamState
from tests.helpers.stack import Stack
from tests.helpers.wait import wait_until

ROOT = pathlib.Path(__file__).resolve().parents[2]
NUM_BLOCKS = 96
PAUSE_S = 0.05  # between the attacker's calls: a steady stream of bad input, not a CPU hog of its own
PER_CLIENT = 6
CANARY = [5, 6, 7, 8, 9]
GREEDY = dict(max_tokens=40, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def stack(tiny_llama_dir):
    with Stack(tiny_llama_dir, num_gpu_blocks=NUM_BLOCKS, num_cpu_blocks=NUM_BLOCKS,
               max_requests_per_client=PER_CLIENT, max_waiting_requests=64) as running:
        yield running


def _own_connection(target: str) -> grpc.Channel:
    """A channel with a connection of its own (channels of one process to one target share one by
    default, and so count as one client: the server tells clients apart by connection)."""
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def _idle(stack: Stack) -> None:
    """Nothing in flight, every block free (none leaked), the block manager's invariants hold."""
    with Client(stack.target) as client:
        def idle() -> bool:
            stats = client.stats()
            return stats.num_free_gpu_blocks == NUM_BLOCKS and stats.num_running == stats.num_waiting == 0

        wait_until(idle, 20, what="every block free")
    stack.check_integrity()


def _serves(stack: Stack) -> None:
    with Client(stack.target) as client:
        assert client.generate([1, 2, 3], max_tokens=3, ignore_eos=True).outputs[0].finish_reason == "length"


# -- defect 1 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("penalty", [2000.0, 1e308, float("-inf")])
def test_a_bad_length_penalty_is_refused_and_the_engine_keeps_serving(stack, penalty):
    with Client(stack.target) as client:
        code, details = _code(lambda: client.generate([1, 2, 3, 4], max_tokens=4, beam_width=2,
                                                      length_penalty=penalty))
    assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith("length_penalty: must be in")
    _serves(stack)


def test_a_request_whose_processing_raises_fails_alone(stack, monkeypatch):
    """Beam scoring that raises (as length_penalty 2000 did) ends that request with ABORTED naming
    the cause; a concurrent greedy stream keeps its exact tokens; the engine serves on."""
    with Client(stack.target) as client:
        quiet = client.generate(CANARY, **GREEDY).outputs[0].token_ids

    def boom(self, cumulative_logprob, num_output_tokens):
        raise OverflowError("(34, 'Numerical result out of range')")

    async def scenario():
        async with AsyncClient(stack.target) as client:
            canary = asyncio.ensure_future(client.generate(CANARY, **GREEDY))
            await asyncio.sleep(0.05)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.generate([1, 2, 3, 4], max_tokens=6, beam_width=2, ignore_eos=True)
            return (await canary).outputs[0].token_ids, info.value

    monkeypatch.setattr(BeamState, "score", boom)
    tokens, err = asyncio.run(scenario())
    monkeypatch.undo()
    assert err.code() is grpc.StatusCode.ABORTED
    assert "internal error while processing this request: OverflowError" in err.details()
    assert tokens == quiet
    with Client(stack.target) as client:
        beams = client.generate([1, 2, 3, 4], max_tokens=4, beam_width=2)
    assert len(beams.outputs) == 2
    _idle(stack)


def test_a_request_whose_output_processing_raises_fails_alone(stack, monkeypatch):
    """The same for the engine's per-request output step (detokenizing, stop strings)."""
    from scheduler_svc.engine.outputs import RequestState

    original = RequestState.sample_output

    def sample_output(self, sample):
        if self.request_id == "doomed":
            raise UnicodeError("a broken tokenizer")
        return original(self, sample)

    monkeypatch.setattr(RequestState, "sample_output", sample_output)
    with Client(stack.target) as client:
        code, details = _code(lambda: client.generate([1, 2], max_tokens=5, request_id="doomed"))
        assert code is grpc.StatusCode.ABORTED and "UnicodeError: a broken tokenizer" in details
        assert client.generate([1, 2], max_tokens=3, ignore_eos=True).outputs[0].finish_reason == "length"
    _idle(stack)


def test_an_engine_loop_that_dies_anyway_makes_the_process_exit(tiny_llama_dir):
    from scheduler_svc.server.main import EngineDiedError, run_until_stopped

    with Stack(tiny_llama_dir, num_gpu_blocks=16, num_cpu_blocks=16) as doomed:
        def schedule():
            raise RuntimeError("a scheduler bug")

        doomed.engine.scheduler.schedule = schedule  # type: ignore[method-assign]
        with Client(doomed.target) as client:
            code, details = _code(lambda: client.generate([1, 2], max_tokens=2))
        assert code is grpc.StatusCode.ABORTED and "a scheduler bug" in details
        with pytest.raises(EngineDiedError, match="RuntimeError: a scheduler bug"):
            doomed.run(run_until_stopped(doomed.scheduler, asyncio.Event()), timeout_s=30)


# -- defect 4 ------------------------------------------------------------------------------------------
def test_a_huge_text_prompt_is_refused_before_tokenizing(stack):
    start = time.monotonic()
    with Client(stack.target) as client:
        code, details = _code(lambda: client.generate("word " * 2_000_000, max_tokens=2))  # 10 MB
    assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith("prompt.text: 10000000 characters")
    assert time.monotonic() - start < 5.0
    _serves(stack)


def test_stop_strings_are_bounded(stack):
    with Client(stack.target) as client:
        code, details = _code(lambda: client.generate([1, 2], max_tokens=2, stop=["x" * 500] * 20_000))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and details == "stop: 20000 stop strings; at most 16"
        code, details = _code(lambda: client.generate([1, 2], max_tokens=2, stop=["x" * 500]))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith("stop: a stop string of 500")


# -- defect 8 ------------------------------------------------------------------------------------------
def test_a_tiny_temperature_is_greedy_with_finite_logprobs(stack):
    with Client(stack.target) as client:
        greedy = client.generate(CANARY, max_tokens=8, temperature=0.0, logprobs=2).outputs[0]
        tiny = client.generate(CANARY, max_tokens=8, temperature=1e-38, logprobs=2).outputs[0]
    assert tiny.token_ids == greedy.token_ids
    assert all(lp.logprob == lp.logprob and lp.logprob > float("-inf") for lp in tiny.logprobs)


def test_malformed_bytes_and_invalid_utf8_are_invalid_argument(stack):
    valid = generation_pb2.GenerateRequest(text="ok ok").SerializeToString()
    with grpc.insecure_channel(stack.target) as channel:
        generate = channel.unary_stream("/pagedserve.v1.Generation/Generate")
        abort = channel.unary_unary("/pagedserve.v1.Generation/Abort")
        for raw in (b"\xff\xff\xff", valid.replace(b"ok ok", b"\xff\xfe ok")):
            code, details = _code(lambda raw=raw: list(generate(raw, timeout=10)))
            assert code is grpc.StatusCode.INVALID_ARGUMENT, details
            assert details.startswith("request: not a valid protobuf message"), details
        code, _ = _code(lambda: abort(b"\xff\xff", timeout=10))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
    _serves(stack)


def test_an_aborted_requests_last_message_reports_its_real_token_count(stack):
    with Client(stack.target) as client:
        stream = client.stream([5, 6, 7], max_tokens=500, ignore_eos=True, request_id="counted")
        received = 0
        for delta in stream:
            received += len(delta.outputs[0].token_ids) if delta.outputs else 0
            if received >= 5:
                break
        assert client.abort("counted") is True
        rest = list(stream)
    received += sum(len(d.outputs[0].token_ids) for d in rest if d.outputs)
    last = rest[-1].outputs[0]
    assert last.finish_reason == "abort" and last.completion_tokens == received >= 5
    _idle(stack)


def test_one_client_over_its_admission_limit_gets_resource_exhausted_and_others_are_served(stack):
    with Client(stack.target) as flood, _own_connection(stack.target) as other:
        streams = [flood.stream([3, 4, i], max_tokens=400, ignore_eos=True) for i in range(PER_CLIENT)]
        for s in streams:
            next(s)
        code, details = _code(lambda: flood.generate([3, 4, 5], max_tokens=2))
        generate = generation_pb2_grpc.GenerationStub(other).Generate
        served = list(generate(build_request([3, 4, 5], max_tokens=2, ignore_eos=True), timeout=30))
        for s in streams:
            s.close()
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details.startswith(f"this client has {PER_CLIENT} requests in flight (limit {PER_CLIENT} ")
    assert served[-1].finished and served[-1].outputs[0].completion_tokens == 2
    with _own_connection(stack.target) as channel:
        info = generation_pb2_grpc.GenerationStub(channel).GetModelInfo(generation_pb2.GetModelInfoRequest())
    assert info.max_requests_per_client == PER_CLIENT  # (the HTTP API refuses more prompts than that)
    _idle(stack)


def test_spoofed_client_metadata_does_not_escape_the_per_client_limit(stack):
    """A Generate call on the scheduler's own port is its connection's, whatever `pagedserve-client`
    metadata it sends: one connection naming a new client per call got every call in."""
    from scheduler_svc.wire.client_identity import CLIENT_KEY

    with _own_connection(stack.target) as channel:
        generate = generation_pb2_grpc.GenerationStub(channel).Generate
        request = build_request([3, 4, 5], max_tokens=400, ignore_eos=True)
        calls = [generate(request, metadata=((CLIENT_KEY, f"someone-{i}"),)) for i in range(PER_CLIENT)]
        for call in calls:
            next(call)  # each one streaming
        over = generate(build_request([3, 4, 5], max_tokens=2), metadata=((CLIENT_KEY, "yet-another"),))
        code, details = _code(lambda: list(over))
        for call in calls:
            call.cancel()
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, details
    _idle(stack)


def test_only_the_client_that_created_a_request_may_abort_it(stack):
    with Client(stack.target) as owner, _own_connection(stack.target) as stranger:
        stream = owner.stream([5, 6, 7], max_tokens=300, ignore_eos=True, request_id="private")
        next(stream)
        abort = generation_pb2_grpc.GenerationStub(stranger).Abort
        assert not abort(generation_pb2.AbortRequest(request_id="private"), timeout=10).found  # "not found"
        assert next(stream).outputs  # still streaming
        assert owner.abort("private") is True
        assert list(stream)[-1].outputs[0].finish_reason == "abort"
    _idle(stack)


# -- the hostile-client soak ------------------------------------------------------------------------------
def _canary(target: str) -> tuple[list[int], list[float]]:
    """The canary's tokens and its inter-token gaps (seconds)."""
    tokens: list[int] = []
    times: list[float] = []
    with Client(target) as client:
        for delta in client.stream(CANARY, max_tokens=400, ignore_eos=True, temperature=0.0):
            if delta.outputs and delta.outputs[0].token_ids:
                tokens.extend(delta.outputs[0].token_ids)
                times.append(time.perf_counter())
    return tokens, [b - a for a, b in zip(times, times[1:], strict=False)]


def _p99(gaps: list[float]) -> float:
    return sorted(gaps)[int(0.99 * (len(gaps) - 1))]


def _attack(target: str, stop: threading.Event, counts: dict[str, int], kinds: str = "tsblmgx",
            report=None) -> None:
    """Another client (a connection of its own): every bad input of issue 14 in turn, until `stop`."""
    bad = [
        build_request("word " * 1_000_000, max_tokens=2),  # huge text
        build_request([1, 2], max_tokens=2, stop=["x" * 500] * 20_000),  # many stop strings
        build_request([1, 2, 3, 4], max_tokens=4, beam_width=2, length_penalty=2000.0),
        build_request([1, 2], max_tokens=2, request_id="r" * (1 << 20)),  # huge request id
    ]

    def count(err: grpc.RpcError) -> None:
        counts[err.code().name] = counts.get(err.code().name, 0) + 1

    with _own_connection(target) as channel:
        generate = generation_pb2_grpc.GenerationStub(channel).Generate
        raw = channel.unary_stream("/pagedserve.v1.Generation/Generate")
        bad = [r for r, k in zip(bad, "tsbl", strict=True) if k in kinds]
        while not stop.is_set():
            for request in bad:
                try:
                    list(generate(request, timeout=30))
                except grpc.RpcError as err:
                    count(err)
                time.sleep(PAUSE_S)
            try:
                if "m" in kinds:
                    list(raw(b"\xff\xff\xff", timeout=30))  # not a protobuf message
            except grpc.RpcError as err:
                count(err)
            if "g" in kinds:
                list(generate(build_request([1, 2], max_tokens=2, temperature=1e-38), timeout=30))
            time.sleep(PAUSE_S)
            if "x" not in kinds:
                continue
            burst = [generate(build_request([7, 8, i], max_tokens=30, ignore_eos=True), timeout=30)
                     for i in range(PER_CLIENT + 4)]  # over the admission limit: RESOURCE_EXHAUSTED
            for call in burst:
                try:
                    next(call)
                except grpc.RpcError as err:
                    count(err)
            for call in burst:
                call.cancel()
            if report is not None:
                report(counts)


def attack_main(target: str, kinds: str = "tsblmgx") -> None:
    """The attacker process's body (a process of its own: its client-side work of encoding 10 MB
    messages must not share the test process's GIL with the server under test). Prints the status
    codes it got so far after each round, one JSON line; runs until terminated."""
    _attack(target, threading.Event(), {}, kinds, report=lambda counts: print(json.dumps(counts), flush=True))


def test_hostile_client_soak(stack):
    """A canary greedy stream keeps its exact tokens and its p99 inter-token latency within 3x of
    its quiet value (or 100 ms: no stall) while another client sends every bad input; no block
    leaks; still serving."""
    _canary(stack.target)  # warm-up
    quiet_tokens, quiet_gaps = _canary(stack.target)
    quiet_p99 = max(_p99(quiet_gaps), _p99(_canary(stack.target)[1]))  # this shared machine's noise
    code = f"from tests.service.test_hostile_clients import attack_main; attack_main({stack.target!r})"
    attacker = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(3.0)  # the attacker's imports, then its first rounds
        noisy_tokens, noisy_gaps = _canary(stack.target)
    finally:
        attacker.terminate()
        reports = attacker.communicate(timeout=30)[0].splitlines()
    counts = json.loads(reports[-1])  # the status codes the attacker got, over its rounds
    assert counts.get("INVALID_ARGUMENT", 0) >= 5 * len(reports), counts
    assert counts.get("RESOURCE_EXHAUSTED", 0) >= len(reports), counts
    assert set(counts) == {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}, counts
    assert noisy_tokens == quiet_tokens
    # No stall: a hostile request that blocked the engine (a 10 MB message decoded on its loop, say)
    # would cost the canary hundreds of ms. The floor is that scale, not the quiet p99's (~6 ms): on a
    # 2-core CI machine the attacker process alone took the canary's p99 to 19 ms once (3.2x).
    assert _p99(noisy_gaps) <= max(3 * quiet_p99, 0.1), (_p99(noisy_gaps), quiet_p99)
    _idle(stack)
    _serves(stack)


# -- defect 3: the front-end link ---------------------------------------------------------------------------
def test_through_the_front_end_a_huge_request_id_is_refused_and_a_dead_link_frees_every_request(stack):
    """An 8 MiB request_id (under --max-request-bytes) is INVALID_ARGUMENT for its caller alone
    (before: the scheduler's batch passed the message limit and every stream on the link ended
    UNAVAILABLE); streams keep their request id although the link sends it once; when the link dies
    every request it opened is aborted (before: 7 of 8 ran on as orphans holding blocks)."""
    from scheduler_svc.frontend.main import start_frontend

    server, port, _, link_task = stack.run(start_frontend(stack.target))
    target = f"127.0.0.1:{port}"
    try:
        with Client(target) as client:
            streams = [client.stream([3, 4, i], max_tokens=1000, ignore_eos=True, temperature=0.0,
                                     request_id=f"linked-{i}") for i in range(PER_CLIENT)]
            firsts = [next(s) for s in streams]
            code, details = _code(lambda: client.generate([1, 2], max_tokens=2, request_id="r" * (8 << 20)))
            assert code is grpc.StatusCode.INVALID_ARGUMENT
            assert details == f"request_id: {8 << 20} characters; at most 256"
            seconds = [next(s) for s in streams]  # the other streams are untouched
            assert [d.request_id for d in firsts + seconds] == [f"linked-{i}" for i in range(PER_CLIENT)] * 2
            assert stack.engine.stats().num_running == PER_CLIENT
            link_task.cancel()  # the link dies with every stream on it
            wait_until(lambda: stack.engine.stats().num_running == 0, 20, what="the link's requests aborted")
    finally:
        stack.run(server.stop(0.5))
        link_task.cancel()
    _idle(stack)
    _serves(stack)
