"""The OpenAI-compatible HTTP API (`pagedserve serve --http-port`) through the official `openai` SDK,
against a real server on the tiny model with a bearer token: completions and chat, streamed and not,
n = 2, stop, seed, logprobs, usage; greedy text and token ids identical to the gRPC API's; every bad
field a 400 naming it while the server keeps serving; 401 / 404; a client that goes away mid-stream
frees every block. And `pagedserve generate` against the same server (one server start for both):
logprobs printed (text and JSON), n samples streamed, Ctrl-C without a traceback."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import re
import signal
import subprocess
import sys

import httpx
import pytest

from clients.client import Client
from tests.helpers.processes import ROOT, serve
from tests.helpers.wait import wait_until

openai = pytest.importorskip("openai")

TOKEN = "s3cret-token"
HTTP_LINE = r"OpenAI-compatible HTTP API: (http://\S+)/v1"
NUM_GPU_BLOCKS = 64


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("openai_http")
    (log_dir / "token").write_text(TOKEN + "\n")
    proc, public = serve(
        ["--model", str(tiny_llama_dir), "--device", "cpu", "--num-gpu-blocks", str(NUM_GPU_BLOCKS),
         "--http-port", "0", "--auth-token-file", str(log_dir / "token"), "--num-cpu-blocks", "100000"],
        log_dir / "serve.log",
    )
    base_url = proc.wait_for(HTTP_LINE, 30)[1]
    assert re.search(r"--num-cpu-blocks 100000 cut to \d+", proc.output())  # said, not silent
    try:
        yield base_url, public
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.stop(timeout_s=60)


@pytest.fixture(scope="module")
def sdk(server):
    with openai.OpenAI(base_url=f"{server[0]}/v1", api_key=TOKEN, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def model(sdk):
    return sdk.models.list().data[0].id


def grpc_greedy(public: str, prompt, max_tokens: int):
    with Client(public, auth_token=TOKEN) as client:
        out = client.generate(prompt, max_tokens=max_tokens, temperature=0.0).outputs[0]
    return out.text, list(out.token_ids)


def test_completions_greedy_matches_the_grpc_api_streamed_or_not(sdk, model, server):
    text, ids = grpc_greedy(server[1], "Hello there", 12)
    whole = sdk.completions.create(model=model, prompt="Hello there", max_tokens=12, temperature=0,
                                   extra_body={"return_token_ids": True})
    assert whole.choices[0].text == text and whole.choices[0].token_ids == ids
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    chunks = list(sdk.completions.create(model=model, prompt="Hello there", max_tokens=12, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"return_token_ids": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == ids
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    # token ids as the prompt give the same answer
    by_ids = sdk.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == grpc_greedy(server[1], [5, 6, 7, 8], 6)[0]


def test_usage_counts_the_prompt_tokens_read_from_the_prefix_cache(sdk, model):
    """usage.prompt_tokens_details.cached_tokens (the server's RequestMetrics): none the first time a
    40-token prompt is seen, its two whole 16-token blocks the second time (prefix caching is on by
    default), streamed or not."""
    prompt = list(range(300, 340))
    first = sdk.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == 40 and first.usage.prompt_tokens_details.cached_tokens == 0
    again = sdk.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    chunks = list(sdk.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32


def test_chat_streamed_and_not_agree_and_usage_counts(sdk, model):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    whole = sdk.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    chunks = list(sdk.chat.completions.create(model=model, messages=messages, max_completion_tokens=8,
                                              temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"


def test_n_seed_stop_and_logprobs(sdk, model):
    def sample():
        return sdk.completions.create(model=model, prompt="Once upon", max_tokens=8, n=2, seed=7,
                                      temperature=1.0)

    first, again = sample(), sample()
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 16
    greedy = sdk.completions.create(model=model, prompt="Once upon", max_tokens=8, temperature=0).choices[0]
    stop = greedy.text[3:5]
    cut = sdk.completions.create(model=model, prompt="Once upon", max_tokens=8, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    lp = sdk.completions.create(model=model, prompt="Once upon", max_tokens=4, temperature=0,
                                logprobs=2).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4 and all(len(t) >= 1 for t in lp.top_logprobs)
    assert all(math.isfinite(x) and x <= 0 for x in lp.token_logprobs)
    chat = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 3 and all(len(e.top_logprobs) == 2 for e in entries)


BAD_FIELDS = [  # (endpoint, extra fields, the field the 400 names)
    ("completions", {"temperature": -1}, "temperature"),
    ("completions", {"top_p": 2}, "top_p"),
    ("completions", {"n": 0}, "n"),
    ("completions", {"n": 10**6}, "n"),
    ("completions", {"max_tokens": -1}, "max_tokens"),
    ("completions", {"max_tokens": 10**9}, "max_tokens"),
    ("completions", {"max_tokens": 10**30}, "max_tokens"),
    ("completions", {"logprobs": 50}, "logprobs"),
    ("completions", {"seed": 2**70}, "seed"),
    ("completions", {"top_k": -3}, "top_k"),
    ("completions", {"stop": ["x"] * 500}, "stop"),
    ("completions", {"prompt": [10**6]}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": {"a": 1}}, "prompt"),
    ("completions", {"presence_penalty": 1.0}, "presence_penalty"),
    ("completions", {"echo": True}, "echo"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ("chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("chat/completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"stop_token_ids": list(range(300))}, "stop_token_ids"),  # at most 256
    # a token id of the wrong value names it (the union's text member said "a valid string")
    ("completions", {"prompt": [5, -1]}, "prompt.1"),
    ("completions", {"prompt": [1.5]}, "prompt.0"),
    # typed strictly: these were coerced (to 5, to true, to token ids [1, 2])
    ("completions", {"max_tokens": "5"}, "max_tokens"),
    ("completions", {"stream": 1}, "stream"),
    ("completions", {"prompt": [1, "2"]}, "prompt.1"),
    # more characters than the context (64 blocks of 16 tokens) could hold at 32 a token: refused before
    # the chat is rendered or tokenized (a 15 MiB message took 24 s of the front-end's loop)
    ("chat/completions", {"messages": [{"role": "user", "content": "ab " * 11_000}]}, "messages"),
]


def test_every_bad_field_is_a_400_naming_it_and_the_server_keeps_serving(server, model, sdk):
    base = {"completions": {"model": model, "prompt": "Hi", "max_tokens": 2},
            "chat/completions": {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                 "max_tokens": 2}}
    headers = {"authorization": f"Bearer {TOKEN}"}
    meanwhile = concurrent.futures.ThreadPoolExecutor(1).submit(  # another user's stream, all along
        lambda: list(sdk.completions.create(model=model, prompt="Hi", max_tokens=150, stream=True,
                                            extra_body={"return_token_ids": True, "ignore_eos": True})))
    with httpx.Client(base_url=f"{server[0]}/v1", headers=headers, timeout=30) as http:
        for _ in range(50):  # a flood of malformed bodies
            assert http.post("/completions", content=b'{"model": 1, "prompt": [[-1]]}').status_code == 400
        for endpoint, fields, param in BAD_FIELDS:
            reply = http.post(f"/{endpoint}", json={**base[endpoint], **fields})
            assert reply.status_code == 400, (fields, reply.text)
            error = reply.json()["error"]
            assert error["param"] == param and param in error["message"], (fields, error)
            assert error["type"] == "invalid_request_error"
        nan = http.post("/completions", content=b'{"model": "%s", "prompt": "Hi", "temperature": NaN}'
                        % model.encode(), headers={"content-type": "application/json"})
        assert nan.status_code == 400 and nan.json()["error"]["param"] == "temperature"
        assert http.post("/completions", content=b"{not json").status_code == 400
        assert http.post("/completions", content=b"x" * (17 << 20)).status_code == 413
    assert sdk.completions.create(model=model, prompt="Hi", max_tokens=3).usage.completion_tokens == 3
    chunks = meanwhile.result(timeout=60)
    assert sum(len(c.choices[0].token_ids) for c in chunks if c.choices) == 150


def test_a_chat_longer_than_the_context_names_messages_not_max_tokens(server, model):
    """Without max_tokens the answer may fill the context; a chat that leaves no room for one is the
    messages' fault (it was reported as max_tokens, which the client never sent)."""
    headers = {"authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=f"{server[0]}/v1", headers=headers, timeout=30) as http:
        reply = http.post("/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "ab " * 1500}]})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "messages" and "no room for an answer" in error["message"], error


def test_samples_that_would_outgrow_the_cache_are_a_400_naming_n(server, model):
    """8 samples of 300 tokens need more than the 64 blocks of the cache together, though one alone
    fits: the scheduler refuses the request up front (INVALID_ARGUMENT naming n over gRPC; it used to
    accept it and drop it mid-stream). Over HTTP that is a 400 naming n, streamed or not, not a 500
    server_error that the SDKs retry."""
    headers = {"authorization": f"Bearer {TOKEN}"}
    body = {"model": model, "prompt": "hi", "n": 8, "max_tokens": 300, "ignore_eos": True}
    with httpx.Client(base_url=f"{server[0]}/v1", headers=headers, timeout=60) as http:
        for stream in (False, True):
            reply = http.post("/completions", json={**body, "stream": stream})
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == "n" and error["type"] == "invalid_request_error", error
            assert "8 sequences of prompt" in error["message"] and "can never fit" in error["message"], error


def test_a_missing_or_wrong_token_is_a_401_and_another_model_a_404(server, model):
    with (openai.OpenAI(base_url=f"{server[0]}/v1", api_key="wrong", max_retries=0) as client,
          pytest.raises(openai.AuthenticationError)):
        client.models.list()
    missing = httpx.post(f"{server[0]}/v1/completions", json={"model": model, "prompt": "Hi"})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server[0]}/health").status_code == 200  # no token needed
    with (openai.OpenAI(base_url=f"{server[0]}/v1", api_key=TOKEN, max_retries=0) as client,
          pytest.raises(openai.NotFoundError) as info):
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
    assert info.value.body["param"] == "model"


def test_a_client_that_goes_away_mid_stream_or_before_the_answer_frees_every_block(server, model):
    body = {"model": model, "prompt": "Hello", "max_tokens": 900, "ignore_eos": True, "stream": True}
    headers = {"authorization": f"Bearer {TOKEN}"}
    with (httpx.Client(base_url=f"{server[0]}/v1", headers=headers, timeout=30) as http,
          http.stream("POST", "/completions", json=body) as reply):
        assert reply.status_code == 200
        lines = reply.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # the connection is closed here, mid-stream
    with Client(server[1], auth_token=TOKEN) as client:
        def all_free():
            stats = client.stats()
            return stats.num_running == stats.num_waiting == 0 and stats.num_free_gpu_blocks == NUM_GPU_BLOCKS

        wait_until(all_free, 30, 0.1, "every block free after the client went away")
        with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up before the answer
            httpx.post(f"{server[0]}/v1/completions", headers=headers, timeout=0.3,
                       json={**body, "stream": False, "max_tokens": 1000})
        wait_until(all_free, 30, 0.1, "every block free after the client gave up")
        assert client.stats().num_free_gpu_blocks == NUM_GPU_BLOCKS


# ---- `pagedserve generate` against the same server (its fixes of issue 16) ----------------------
def _generate(server, tmp_path, *args: str) -> subprocess.CompletedProcess:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    cmd = [sys.executable, "-m", "clients.cli", "generate", "--server", server[1], "--auth-token-file",
           str(token), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_generate_prints_logprobs_and_streams_every_sample(server, tmp_path):
    text = _generate(server, tmp_path, "--prompt", "Hi", "--max-tokens", "4", "--temperature", "0",
                     "--logprobs", "2")
    assert text.returncode == 0, text.stderr
    line = next(line for line in text.stdout.splitlines() if line.startswith("logprobs [0]: "))
    assert len(line.split(": ", 1)[1].split()) == 4
    as_json = _generate(server, tmp_path, "--prompt", "Hi", "--max-tokens", "4", "--temperature", "0",
                        "--logprobs", "2", "--json")
    logprobs = json.loads(as_json.stdout)["outputs"][0]["logprobs"]
    assert len(logprobs) == 4 and all(len(lp["top"]) == 2 for lp in logprobs)
    samples = _generate(server, tmp_path, "--prompt", "Hi", "--max-tokens", "6", "--n", "2", "--seed", "1",
                        "--ignore-eos")
    assert samples.returncode == 0 and "[0] " in samples.stdout and "[1] " in samples.stdout
    assert "[0: length]  [1: length]" in samples.stdout


def test_generate_interrupted_prints_no_traceback(server, tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    cmd = [sys.executable, "-m", "clients.cli", "generate", "--server", server[1], "--auth-token-file",
           str(token), "--prompt", "Hi", "--max-tokens", "900", "--ignore-eos"]
    # A shell's background job (`.ci/run &`, nohup) starts with SIGINT ignored, and Python keeps an
    # ignored SIGINT ignored: give the client the default disposition, as a terminal's Ctrl-C meets it.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None and proc.stdout.read(1)  # streaming has begun
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err and "interrupted" in err


def test_two_front_ends_serve_one_http_port(tiny_llama_dir, tmp_path):
    """--api-frontends 2 with --http-port: both front-ends listen on the HTTP port too (SO_REUSEPORT);
    fresh connections are answered while either of them is killed."""
    import os

    from tests.helpers.processes import pids_of

    proc, _ = serve(["--model", str(tiny_llama_dir), "--device", "cpu", "--num-gpu-blocks", "64",
                     "--http-port", "0", "--api-frontends", "2"], tmp_path / "serve.log")
    try:
        wait_until(lambda: len(re.findall(HTTP_LINE, proc.output())) == 2, 30, 0.1, "both HTTP APIs")
        urls = set(re.findall(HTTP_LINE, proc.output()))
        assert len(urls) == 1, urls  # both front-ends serve the same address
        base_url = urls.pop()
        frontends = pids_of("scheduler_svc.frontend.main", parent=proc.pid)
        assert len(frontends) == 2

        def completion() -> str:
            with httpx.Client(base_url=f"{base_url}/v1", timeout=30) as http:  # a fresh connection
                model = http.get("/models").json()["data"][0]["id"]
                body = {"model": model, "prompt": [4, 5, 6], "max_tokens": 4, "temperature": 0.0}
                reply = http.post("/completions", json=body)
                assert reply.status_code == 200, reply.text
                return reply.json()["choices"][0]["text"]

        first = [completion() for _ in range(4)]
        assert len(set(first)) == 1
        os.kill(frontends[0], signal.SIGKILL)
        assert [completion() for _ in range(3)] == first[:3]  # the other front-end holds the port
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.stop(timeout_s=60)
