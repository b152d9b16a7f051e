"""The HTTP API's app (scheduler_svc/frontend/http_app.py) in process, over a scripted link: 503 while
draining, while the link is down and when the scheduler answers UNAVAILABLE; a 400 for a chat on a
model with no template; a link that breaks mid-stream ends the stream with an error event and
[DONE]; several prompts stream as one, each choice under its own index, the usage summing their
prompt tokens and those read from the prefix cache (RequestMetrics); every stream is closed
(cancelled in the scheduler) when the exchange ends."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from protos.pagedserve.v1 import frontend_pb2, generation_pb2
from scheduler_svc.frontend.chat import ModelText
from scheduler_svc.frontend.http_app import HttpApi
from scheduler_svc.wire.chat_template import ChatTemplate
from scheduler_svc.wire.errors import ServiceUnavailableError

pytest.importorskip("starlette")


def _response(text: str, finished: bool, index: int = 0) -> generation_pb2.GenerateResponse:
    reason = generation_pb2.FINISH_REASON_LENGTH if finished else generation_pb2.FINISH_REASON_UNSPECIFIED
    out = generation_pb2.OutputDelta(index=index, text=text, token_ids=[7], finish_reason=reason,
                                     completion_tokens=1)
    response = generation_pb2.GenerateResponse(outputs=[out], prompt_tokens=3, finished=finished)
    if finished:  # the last response carries the request's metrics: 2 of its 3 prompt tokens were cached
        response.metrics.cached_prompt_tokens = 2
    return response


class ScriptedLink:
    """Answers every stream with `script(request)`'s events (None: the link broke)."""

    def __init__(self, script):
        self.script, self.up = script, True
        self.requests: list = []
        self.apis: list[str] = []  # the api each stream was opened with
        self.clients: list[str] = []  # and the client
        self.open_streams: set[int] = set()
        self.cancelled: list[int] = []
        self.queues: list[asyncio.Queue] = []  # each stream's, to add events to later

    def open(self, request, client="", api="openai"):
        if not self.up:
            raise ServiceUnavailableError("the scheduler is not reachable")
        stream_id = len(self.requests)
        self.requests.append(request)
        self.apis.append(api)
        self.clients.append(client)
        queue: asyncio.Queue = asyncio.Queue()
        for event in self.script(request):
            queue.put_nowait(event)
        self.open_streams.add(stream_id)
        self.queues.append(queue)
        return stream_id, queue

    def close(self, stream_id, cancel):
        self.open_streams.discard(stream_id)
        if cancel:
            self.cancelled.append(stream_id)


def two_tokens(request):
    word = request.text or "ids"
    return [frontend_pb2.StreamEvent(response=_response(word + "-a", False)),
            frontend_pb2.StreamEvent(response=_response("-b", True), end=True)]


def call(api: HttpApi, method: str, path: str, body=None):
    async def go():
        transport = httpx.ASGITransport(app=api.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.request(method, path, json=body)

    return asyncio.run(go())


def events(reply: httpx.Response) -> list:
    lines = [line.removeprefix("data: ") for line in reply.text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def make_api(script=two_tokens, template: str = "") -> tuple[HttpApi, ScriptedLink]:
    link = ScriptedLink(script)
    return HttpApi(link, "m", 1024, ModelText(ChatTemplate(template))), link


COMPLETION = {"model": "m", "prompt": "x", "max_tokens": 2}


def test_503_while_draining_while_the_link_is_down_and_when_the_scheduler_says_unavailable():
    api, link = make_api()
    assert call(api, "POST", "/v1/completions", COMPLETION).status_code == 200
    api.draining = True
    reply = call(api, "POST", "/v1/completions", COMPLETION)
    assert reply.status_code == 503 and reply.json()["error"]["type"] == "service_unavailable"
    assert call(api, "GET", "/health").status_code == 503
    api.draining, link.up = False, False
    assert call(api, "POST", "/v1/completions", COMPLETION).status_code == 503
    unavailable = [frontend_pb2.StreamEvent(end=True, code=14, message="the server is draining")]
    api, _ = make_api(lambda request: unavailable)
    reply = call(api, "POST", "/v1/completions", {**COMPLETION, "stream": True})
    assert reply.status_code == 503 and "draining" in reply.json()["error"]["message"]


def test_a_chat_without_a_template_is_a_400_naming_messages():
    api, link = make_api()
    reply = call(api, "POST", "/v1/chat/completions",
                 {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
    assert "chat template" in reply.json()["error"]["message"] and not link.requests


def test_a_link_that_breaks_mid_stream_ends_it_with_an_error_event():
    api, link = make_api(lambda request: [frontend_pb2.StreamEvent(response=_response("a", False)), None])
    reply = call(api, "POST", "/v1/completions", {**COMPLETION, "stream": True})
    chunks = events(reply)
    assert chunks[0]["choices"][0]["text"] == "a"
    assert chunks[-1]["error"]["type"] == "service_unavailable"
    assert not link.open_streams


def test_several_prompts_stream_as_one_with_their_own_indices_and_usage():
    api, link = make_api()
    body = {**COMPLETION, "prompt": ["p", "q"], "n": 1, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = events(call(api, "POST", "/v1/completions", body))
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "p-a-b", 1: "q-a-b"}
    assert chunks[-1]["usage"] == {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8,
                                   "prompt_tokens_details": {"cached_tokens": 4}}
    assert not link.open_streams and not link.cancelled  # finished streams are not cancelled
    whole = call(api, "POST", "/v1/completions", {**COMPLETION, "prompt": [[1, 2], [3]]}).json()
    assert [c["text"] for c in whole["choices"]] == ["ids-a-b", "ids-a-b"]
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    assert list(link.requests[-1].token_ids.ids) == [3]
    assert link.apis == ["openai"] * 4  # the scheduler's metrics label each prompt's request api="openai"


def _accepted(request):
    event = frontend_pb2.StreamEvent(accepted=True)
    event.response.request_id, event.response.prompt_tokens = "r1", 3
    return [event]


def test_a_stream_answers_its_headers_once_queued_before_its_first_token():
    """A stream's 200 and headers go out when the scheduler has queued its request (its acceptance
    event), not at the first token, which may come after seconds in the queue; the tokens then follow
    on the open stream."""
    async def go():
        api, link = make_api(_accepted)
        body = json.dumps({**COMPLETION, "prompt": ["p", "q"], "stream": True}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000), "server": ("t", 80),
                 "headers": [(b"host", b"t"), (b"content-type", b"application/json")]}
        requests = [{"type": "http.request", "body": body, "more_body": False}]
        never = asyncio.Event()

        async def receive():
            if requests:
                return requests.pop()
            await never.wait()  # the client stays
            return {"type": "http.disconnect"}

        sent: list[dict] = []

        async def send(message):
            sent.append(message)

        answer = asyncio.ensure_future(api.app(scope, receive, send))
        for _ in range(200):
            if sent:
                break
            await asyncio.sleep(0.01)
        assert sent and sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200, sent
        assert not any(m.get("body") for m in sent[1:])  # no token has come
        assert len(link.queues) == 2 and not answer.done()
        for queue, word in zip(link.queues, "pq", strict=True):
            queue.put_nowait(frontend_pb2.StreamEvent(response=_response(word, True), end=True))
        await asyncio.wait_for(answer, 5)
        text = b"".join(m.get("body", b"") for m in sent[1:]).decode()
        assert '"text":"p"' in text.replace(" ", "") and '"text":"q"' in text.replace(" ", "")
        assert text.rstrip().endswith("[DONE]")

    asyncio.run(go())


def test_unknown_fields_are_ignored_and_unsupported_ones_refused():
    api, _ = make_api()
    assert call(api, "POST", "/v1/completions", {**COMPLETION, "user": "u", "whatever": 1}).status_code == 200
    reply = call(api, "POST", "/v1/completions", {**COMPLETION, "logit_bias": {"5": 1.0}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "logit_bias"
    assert call(api, "GET", "/v1/completions").status_code == 405
    metrics = call(api, "GET", "/metrics").text
    series = 'pagedserve_http_requests_total{api="openai",endpoint="completions",model_name="m",status="400"}'
    assert series in metrics


def test_a_chat_template_file_overrides_the_reported_one(tiny_llama_dir, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
                        "{{ bos_token }}")
    reported = ChatTemplate("unused", bos_token="<s>")
    text = ModelText.with_override(reported, str(tiny_llama_dir), str(template))
    ids = text.render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text.tokenizer is not None
    assert ids == text.tokenizer.encode("[user] hi <s>", add_special_tokens=False).ids
    api, link = make_api(template="")
    api.text = text
    reply = call(api, "POST", "/v1/chat/completions",
                 {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert reply.status_code == 200 and list(link.requests[0].token_ids.ids) == ids
    assert reply.json()["choices"][0]["message"] == {"role": "assistant", "content": "ids-a-b"}


def test_a_client_that_disconnects_before_a_whole_answer_cancels_its_request():
    api, link = make_api(lambda request: [])  # the scheduler never answers

    async def scenario():
        body = json.dumps(COMPLETION).encode()
        messages = [{"type": "http.request", "body": body, "more_body": False}]
        disconnected = asyncio.Event()

        async def receive():
            if messages:
                return messages.pop(0)
            await asyncio.sleep(0.05)
            disconnected.set()
            return {"type": "http.disconnect"}

        async def send(message):
            pass

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
                 "query_string": b"", "asgi": {"version": "3.0"}}
        await asyncio.wait_for(api.app(scope, receive, send), 5)
        assert disconnected.is_set()

    asyncio.run(scenario())
    assert link.cancelled == [0] and not link.open_streams



class PacedLink(ScriptedLink):
    """Each stream gets `tokens` events, one every `period_s`."""

    def __init__(self, tokens: int, period_s: float):
        super().__init__(lambda request: [])
        self.tokens, self.period_s = tokens, period_s

    def open(self, request, client="", api="openai"):
        stream_id, queue = super().open(request, api)

        async def feed():
            for i in range(self.tokens):
                await asyncio.sleep(self.period_s)
                last = i == self.tokens - 1
                queue.put_nowait(frontend_pb2.StreamEvent(response=_response("t", last), end=last))

        asyncio.ensure_future(feed())
        return stream_id, queue


def test_a_drain_lets_a_stream_in_flight_finish_and_refuses_new_calls():
    from scheduler_svc.frontend.http_app import HttpService, start_http_server

    async def scenario():
        link = PacedLink(tokens=10, period_s=0.05)
        api = HttpApi(link, "m", 1024, ModelText(ChatTemplate("")))
        server, port, task = await start_http_server(api, "127.0.0.1", 0)
        service = HttpService(api, server, port, task)
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base) as client, httpx.AsyncClient(base_url=base) as other:
            async with client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}) as reply:
                stopping = asyncio.ensure_future(service.stop(5.0))
                await asyncio.sleep(0.1)
                refused = await other.post("/v1/completions", json=COMPLETION)
                body = (await reply.aread()).decode()
            await asyncio.wait_for(stopping, 5)
        return refused, body

    refused, body = asyncio.run(scenario())
    assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
    assert body.count('"text":"t"') == 10 and body.endswith("data: [DONE]\n\n")


def test_front_end_options_refuse_a_bad_http_port_or_a_missing_template(tmp_path):
    from scheduler_svc.frontend.main import FrontendOptions

    for port in (-1, 65536, 10**9):
        with pytest.raises(ValueError, match="http_port"):
            FrontendOptions(engine="h:1", http_port=port)
    with pytest.raises(ValueError, match="chat_template"):
        FrontendOptions(engine="h:1", chat_template=str(tmp_path / "missing.jinja"))
    assert FrontendOptions(engine="h:1", http_port=0).http_port == 0


def test_a_chat_template_is_compiled_once_per_source():
    from scheduler_svc.wire import chat_template

    template = ChatTemplate("{% for m in messages %}{{ m.content }}|{% endfor %}")
    template.render([{"role": "user", "content": "a"}])
    before = chat_template._compiled.cache_info()
    assert template.render([{"role": "user", "content": "b"}]) == "b|"
    after = chat_template._compiled.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses
    with pytest.raises(ValueError, match="refused"):
        ChatTemplate("{% if %}").render([])  # a broken template: an error, not a cached failure


def test_each_http_connection_is_its_own_client_for_the_admission_limit():
    """The scheduler's --max-requests-per-client counts an HTTP client by its connection, as a gRPC
    client by its peer; every prompt of one request is the same client's."""
    api, link = make_api()

    async def go(port):
        transport = httpx.ASGITransport(app=api.app, client=("10.1.2.3", port))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/completions", json={**COMPLETION, "prompt": ["x", "y"]})

    assert asyncio.run(go(4001)).status_code == 200
    assert asyncio.run(go(4002)).status_code == 200
    assert link.clients == ["http:10.1.2.3:4001"] * 2 + ["http:10.1.2.3:4002"] * 2


def _drive(api: HttpApi, chunks: list[bytes], then_disconnect: bool = False, path: str = "/v1/completions"):
    """The app answering one POST whose body comes in `chunks` (no content-length: chunked), then
    the client staying or going away; returns (messages sent, receive calls made)."""
    async def go():
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "client": ("127.0.0.1", 5001), "server": ("t", 80),
                 "headers": [(b"host", b"t"), (b"content-type", b"application/json"),
                             (b"transfer-encoding", b"chunked")]}
        pending = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
        pending.append({"type": "http.disconnect"} if then_disconnect else
                       {"type": "http.request", "body": b"", "more_body": False})
        received, sent = [0], []

        async def receive():
            received[0] += 1
            if pending:
                return pending.pop(0)
            await asyncio.Event().wait()

        async def send(message):
            sent.append(message)

        await asyncio.wait_for(api.app(scope, receive, send), 10)
        return sent, received[0]

    return asyncio.run(go())


def test_a_chunked_body_is_refused_once_past_the_limit_not_after_it_is_all_read():
    """A body without a content-length (chunked) is read up to the limit: a 400 MiB one was held
    whole (the front-end at 869 MiB) before its 413."""
    api, link = make_api()
    mib = b"x" * (1 << 20)
    sent, received = _drive(api, [mib] * 400)
    assert sent[0]["status"] == 413 and received <= api.max_body_bytes // len(mib) + 1
    assert b"larger than" in sent[1]["body"] and not link.requests
    ok, _ = _drive(api, [json.dumps(COMPLETION).encode()])  # a small chunked body is read whole
    assert ok[0]["status"] == 200


def test_a_client_gone_mid_body_is_a_499_not_a_server_error(caplog):
    api, link = make_api()
    sent, _ = _drive(api, [b'{"model": "m", "pro'], then_disconnect=True)
    assert sent[0]["status"] == 499 and not link.requests
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # no traceback logged


def test_a_request_over_the_links_message_size_is_a_413_not_a_429():
    from scheduler_svc.wire.errors import ResourceExhaustedError

    api, link = make_api()

    def too_big(request, client="", api="openai"):
        raise ResourceExhaustedError("the request is 16777223 bytes with its link envelope; at most "
                                     "16777216 (--max-request-bytes)")

    link.open = too_big
    reply = call(api, "POST", "/v1/completions", COMPLETION)
    assert reply.status_code == 413 and "link envelope" in reply.json()["error"]["message"]


def test_a_rendered_chat_the_scheduler_finds_too_long_names_messages_not_prompt(tiny_llama_dir):
    refused = [frontend_pb2.StreamEvent(end=True, code=3, message="prompt: 30014 tokens can never fit in "
                                                                  "the KV cache (64 blocks of 16 tokens)")]
    api, _ = make_api(lambda request: refused)
    api.text = ModelText(ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}"),
                         str(tiny_llama_dir))
    for stream in (False, True):
        reply = call(api, "POST", "/v1/chat/completions",
                     {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream})
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == "messages", error
        assert error["message"].startswith("messages: 30014 tokens can never fit"), error


def test_calls_still_in_flight_when_the_drain_ends_are_told_so_not_cut():
    """Past the drain's grace period (HttpService.stop) every call in flight ends with UNAVAILABLE
    naming why: a stream with an error event and [DONE] (its connection was cut, no event), a whole
    answer with a 503 JSON (a plain-text 500 before); their requests are cancelled."""
    async def go():
        api, link = make_api(_accepted)
        stream = httpx.AsyncClient(transport=httpx.ASGITransport(app=api.app), base_url="http://t")
        async with stream as client:
            streamed = asyncio.ensure_future(
                client.post("/v1/completions", json={**COMPLETION, "stream": True}))
            whole = asyncio.ensure_future(client.post("/v1/completions", json=COMPLETION))
            for _ in range(200):
                if len(link.queues) == 2 and len(api._calls) == 2:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # both accepted, no token: waiting in the scheduler's queue
            assert api.cut_off("the server stopped (test)") == 2
            s, w = await asyncio.wait_for(streamed, 5), await asyncio.wait_for(whole, 5)
        assert s.status_code == 200
        error = events(s)[-1]["error"]
        assert error["type"] == "service_unavailable" and "the server stopped (test)" in error["message"]
        assert w.status_code == 503 and "the server stopped (test)" in w.json()["error"]["message"]
        assert sorted(link.cancelled) == [0, 1] and not api._calls

    asyncio.run(go())


def test_more_prompts_than_a_client_may_have_in_flight_is_a_400_not_a_429():
    """Each prompt is a request: a completion of more prompts than --max-requests-per-client (the
    scheduler's GetModelInfo) could never be admitted, and a 429 said to retry."""
    api, link = make_api()
    api.max_requests_per_client = 2
    reply = call(api, "POST", "/v1/completions", {**COMPLETION, "prompt": ["a", "b", "c"]})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "prompt" and "at most 2" in error["message"]
    assert not link.requests
    assert call(api, "POST", "/v1/completions", {**COMPLETION, "prompt": ["a", "b"]}).status_code == 200


def test_logprobs_give_byte_tokens_their_own_bytes_and_names(tiny_llama_dir):
    """A token that is part of a character decodes alone to U+FFFD: OpenAI's `bytes` must be its own
    bytes (they were U+FFFD's, [239, 191, 189]), and its name "bytes:\\xNN", so that completions'
    top_logprobs (keyed by name) keeps every such alternative (they overwrote each other)."""
    from scheduler_svc.frontend.openai_convert import Choice, chat_logprobs, completion_logprobs

    text = ModelText(ChatTemplate(""), str(tiny_llama_dir))
    tok = text.tokenizer
    lead, tail = tok.token_to_id("Ã"), tok.token_to_id("©")  # the byte-level pieces of 0xC3 and 0xA9
    assert None not in (lead, tail) and text.token_text(lead) == text.token_text(tail) == "\ufffd"
    assert (text.token_bytes(lead) + text.token_bytes(tail)).decode() == "é"
    assert (text.token_label(lead), text.token_label(tail)) == ("bytes:\\xc3", "bytes:\\xa9")
    space, a = tok.token_to_id("Ġ"), tok.token_to_id("a")
    assert text.token_bytes(space) == b" " and (text.token_label(a), text.token_bytes(a)) == ("a", b"a")
    out = generation_pb2.OutputDelta(token_ids=[lead])
    out.logprobs.token_logprobs.append(-0.5)
    out.logprobs.num_top.append(3)
    out.logprobs.top_token_ids.extend([lead, tail, a])
    out.logprobs.top_logprobs.extend([-0.5, -1.0, -2.0])
    entry = chat_logprobs(out, text)[0]
    assert entry["bytes"] == [0xC3] and entry["token"] == "bytes:\\xc3"
    assert [t["bytes"] for t in entry["top_logprobs"]] == [[0xC3], [0xA9], [ord("a")]]
    cmpl = completion_logprobs(out, text, Choice(0))
    assert cmpl["top_logprobs"] == [{"bytes:\\xc3": -0.5, "bytes:\\xa9": -1.0, "a": -2.0}]
    assert cmpl["tokens"] == ["bytes:\\xc3"] and cmpl["text_offset"] == [0]


def test_connections_that_never_finish_a_request_are_closed_not_held(monkeypatch):
    """Slowloris: a connection that sends nothing, or half its headers, is closed past the header
    limit (one adversarial run held 21,000 until the front-end ran out of file descriptors); a body
    that stalls gets a 408; a prompt client is served all along (http_guard.py)."""
    import socket

    from scheduler_svc.frontend import http_guard
    from scheduler_svc.frontend.http_app import start_http_server

    monkeypatch.setattr(http_guard, "HEADER_TIMEOUT_S", 0.5)
    monkeypatch.setattr(http_guard, "BODY_IDLE_TIMEOUT_S", 0.5)

    def closed_within(sock: socket.socket, seconds: float) -> bytes:
        sock.settimeout(seconds)
        got = b""
        while chunk := sock.recv(4096):  # b"" once the server closes
            got += chunk
        return got

    async def go():
        api, _ = make_api()
        server, port, task = await start_http_server(api, "127.0.0.1", 0)
        try:
            silent = socket.create_connection(("127.0.0.1", port))
            half = socket.create_connection(("127.0.0.1", port))
            half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
            stalled = socket.create_connection(("127.0.0.1", port))
            stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 100\r\n\r\n{\"model\": ")
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                ok = await client.post("/v1/completions", json=COMPLETION)  # served meanwhile
            silent_got, half_got, stalled_got = await asyncio.gather(*(
                asyncio.to_thread(closed_within, s, 5.0) for s in (silent, half, stalled)))
            for s in (silent, half, stalled):
                s.close()
            return ok, silent_got, half_got, stalled_got
        finally:
            server.should_exit = True
            await task

    ok, silent_got, half_got, stalled_got = asyncio.run(go())
    assert ok.status_code == 200
    assert silent_got == b"" and half_got == b""  # closed (a recv timeout would have raised)
    assert stalled_got.startswith(b"HTTP/1.1 408") and b"stalled" in stalled_got


def test_the_body_limit_follows_the_servers_context():
    """A server takes a body as large as MAX_PROMPTS prompts of its whole context could need (16 bytes a
    token, plus 1 MiB), at most MAX_BODY_BYTES: validating one holds the event loop for its length, so
    a short-context server refuses a big body with a 413 that names its limit and why, and takes one
    just under it (validated off the loop, on a thread); a malformed big body is a 400 naming the field."""
    from scheduler_svc.frontend.http_app import MAX_BODY_BYTES, THREAD_BODY_BYTES, body_limit
    from scheduler_svc.frontend.openai_schema import MAX_PROMPTS

    assert body_limit(1024) == (1 << 20) + MAX_PROMPTS * 1024 * 16 == 2 << 20
    assert body_limit(8192) == 9 << 20 and body_limit(131072) == MAX_BODY_BYTES
    api, link = make_api()  # a 1,024-token context: 2 MiB
    assert api.max_body_bytes == 2 << 20
    ids = [100000 + i for i in range(1024)]
    big = {**COMPLETION, "prompt": [ids] * MAX_PROMPTS}  # every prompt a whole context of 6-digit ids
    size = len(json.dumps(big))
    assert THREAD_BODY_BYTES < size < api.max_body_bytes
    reply = call(api, "POST", "/v1/completions", big)
    assert reply.status_code == 200, reply.text
    assert len(link.requests) == MAX_PROMPTS and list(link.requests[-1].token_ids.ids) == ids
    over = {**COMPLETION, "prompt": "x" * (api.max_body_bytes + 1)}
    reply = call(api, "POST", "/v1/completions", over)
    message = reply.json()["error"]["message"]
    assert reply.status_code == 413 and "larger than 2097152 bytes" in message
    assert "1024-token context" in message
    assert len(link.requests) == MAX_PROMPTS  # nothing more reached the scheduler
    malformed = {**COMPLETION, "prompt": [ids] * 40 + [ids[:-1] + ["x"]]}
    assert len(json.dumps(malformed)) > THREAD_BODY_BYTES
    reply = call(api, "POST", "/v1/completions", malformed)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt.40.1023", reply.text
    assert len(link.requests) == MAX_PROMPTS


def test_an_http_port_in_use_is_refused_by_name_and_the_grpc_server_stopped(monkeypatch):
    """The HTTP API's port is another server's: start_http_server raises an OSError naming the address
    (uvicorn's own exit turned into it); the front-end then stops its gRPC server, already started,
    before the error leaves `serve` (nothing left to the interpreter's exit), and its main exits with
    the message."""
    import socket

    from scheduler_svc.frontend import http_app
    from scheduler_svc.frontend import main as frontend_main

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        api, _ = make_api()
        bind_failed = rf"cannot listen on 127.0.0.1:{port} \(the error above: the port in use"
        with pytest.raises(OSError, match=bind_failed):
            asyncio.run(http_app.start_http_server(api, "127.0.0.1", port))

        stopped: list[float] = []

        class FakeServer:
            async def stop(self, grace):
                stopped.append(grace)

        async def fake_frontend(*args, on_link, **kwargs):
            on_link(object())
            return FakeServer(), 1234, None, asyncio.ensure_future(asyncio.sleep(60))

        async def no_http(*args, **kwargs):
            raise OSError(f"the HTTP API cannot listen on 127.0.0.1:{port}: the port is in use")

        monkeypatch.setattr(frontend_main, "start_frontend", fake_frontend)
        monkeypatch.setattr(http_app, "start_http_api", no_http)
        refused = f"frontend.main: the HTTP API cannot listen on 127.0.0.1:{port}"
        with pytest.raises(SystemExit, match=refused):
            frontend_main.main(["--engine", "h:1", "--http-port", str(port)])
        assert stopped == [0]
    finally:
        taken.close()
