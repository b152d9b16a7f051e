"""The OpenAI-compatible HTTP API of the API front-end process (Starlette on uvicorn, bodies checked by
the pydantic models of openai_schema.py):

    POST /v1/completions        prompt: text, texts, token ids or lists of them; streamed or not
    POST /v1/chat/completions   messages rendered by the model's chat template (chat.py)
    GET  /v1/models             the served model
    GET  /health                200 while serving, 503 while the scheduler is unreachable,
                                recovering or draining (no token needed)
    GET  /metrics               pagedserve_http_requests_total{api="openai",endpoint,status}

Each request becomes the GenerateRequest(s) the gRPC API sends, over the same link to the scheduler,
which validates it as it validates every request. Errors are OpenAI's JSON error shape with its
status: 400 naming the field, 401 for a missing or wrong bearer token (with --auth-token-file), 404 for
another model, 503 while draining or recovering. A client that goes away aborts its requests (their
KV blocks are freed at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

import pydantic
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from protos.pagedserve.v1 import generation_pb2
from scheduler_svc.frontend import http_guard
from scheduler_svc.frontend.chat import ModelText
from scheduler_svc.frontend.http_errors import HttpError, error_response, http_error
from scheduler_svc.frontend.http_stream import Exchange, SSEResponse, collect, sse_events
from scheduler_svc.frontend.link_call import LinkCall, StreamLink
from scheduler_svc.frontend.openai_convert import chat_request, completion_requests
from scheduler_svc.frontend.openai_schema import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from scheduler_svc.wire.chat_template import ChatTemplate
from scheduler_svc.wire.errors import ApiError, ResourceExhaustedError

MAX_BODY_BYTES = 16 << 20  # the most any server takes; each takes body_limit's share of it
# A body's bytes per token a server's limits allow: every token of MAX_PROMPTS prompts of the model's
# whole context, at up to this many bytes each (a token id and its comma take at most 8; text with JSON
# escapes rarely 16), plus the other fields. Validating a body holds the front-end's event loop (and
# every other stream on it) for its length: 7.5-7.7 MiB of token ids 150-175 ms on the 2-core dev
# machine, 60-110 ms when validated on a thread (pydantic holds the GIL, so not zero; `python -m
# clients.bench.body_parse` prints these). So a server of a short context refuses big bodies early.
BODY_BYTES_PER_TOKEN = 16
BODY_SLACK_BYTES = 1 << 20
THREAD_BODY_BYTES = 256 << 10  # a body larger than this is validated on a worker thread


def body_limit(max_context_tokens: int) -> int:
    """The largest request body (bytes) a server of this context takes (413 past it)."""
    return min(MAX_BODY_BYTES, BODY_SLACK_BYTES + MAX_PROMPTS * max_context_tokens * BODY_BYTES_PER_TOKEN)


CUT_OFF_FLUSH_S = 1.0  # for the streams ended at the drain's end to send their error event and [DONE]
_log = logging.getLogger(__name__)
# The front-end's own series (the scheduler's request metrics count what reaches it, as api="openai").
REQUESTS = Counter("pagedserve_http_requests", "HTTP API requests answered, by endpoint and status",
                   ["model_name", "api", "endpoint", "status"])


class HttpApi:
    """The app and what it serves: the link, the model's name and limits, its text (chat.py), the
    token; `draining` (set on SIGTERM) makes every API call a 503."""

    def __init__(self, link: StreamLink, model_name: str, max_context_tokens: int, text: ModelText,
                 auth_token: str | None = None, is_serving: Callable[[], bool] = lambda: True,
                 max_requests_per_client: int | None = None):
        self.link, self.model_name, self.text = link, model_name, text
        self.max_requests_per_client = max_requests_per_client  # the scheduler's (GetModelInfo)
        self.max_context_tokens = max_context_tokens
        self.max_body_bytes = body_limit(max_context_tokens)
        self.model_names = {model_name, model_name.rstrip("/").rsplit("/", 1)[-1]}
        self._auth = f"Bearer {auth_token}".encode() if auth_token else None
        self.is_serving = is_serving
        self.draining = False
        self.num_in_flight = 0
        self._calls: set[LinkCall] = set()  # every call of an exchange in flight (cut_off ends them)
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/v1/completions", self._endpoint("completions", self._completions), methods=["POST"]),
            Route("/v1/chat/completions", self._endpoint("chat", self._chat), methods=["POST"]),
            Route("/v1/models", self._endpoint("models", self._models), methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
        ])

    def _endpoint(self, name: str, handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            self.num_in_flight += 1  # until the answer is sent: a stream's, when it closes
            streaming = False
            try:
                self._check_auth(request)
                if self.draining:
                    raise HttpError(503, "the server is draining (shutting down); retry elsewhere")
                response = await handler(request)
                if isinstance(response, SSEResponse):
                    response.on_close.append(self._stream_closed)
                    streaming = True
            except HttpError as err:
                response = error_response(err)
            except ClientDisconnect:  # gone mid-body: no one to answer, nothing of the server's failed
                response = error_response(HttpError(499, "the client closed the connection"))
            except (ApiError, pydantic.ValidationError) as exc:
                response = error_response(http_error(exc))
            except Exception as exc:  # noqa: BLE001 - one request's failure stops nothing else
                _log.exception("%s failed", name)
                response = error_response(http_error(exc))
            finally:
                if not streaming:
                    self.num_in_flight -= 1
            if response.status_code in (408, 413, 499):  # the body was not read to its end: not reusable
                response.headers["connection"] = "close"
            REQUESTS.labels(self.model_name, "openai", name, str(response.status_code)).inc()
            return response

        return endpoint

    def _stream_closed(self) -> None:
        self.num_in_flight -= 1

    def _check_auth(self, request: Request) -> None:
        if self._auth is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, self._auth):
            raise HttpError(401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                            code="invalid_api_key")

    def _too_large(self) -> HttpError:
        return HttpError(413, f"the request body is larger than {self.max_body_bytes} bytes, this server's "
                              f"limit ({MAX_PROMPTS} prompts of its {self.max_context_tokens}-token context "
                              f"at {BODY_BYTES_PER_TOKEN} bytes a token, plus {BODY_SLACK_BYTES >> 20} MiB, "
                              f"at most {MAX_BODY_BYTES >> 20} MiB)")

    async def _body(self, request: Request, schema: type[pydantic.BaseModel]) -> Any:
        declared = request.headers.get("content-length", "0")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        # read as it comes, up to the limit: a chunked body declares no length (one of 400 MiB was
        # held whole, the process at 869 MiB, before its 413)
        chunks, size = [], 0
        stream = request.stream()
        while True:
            try:  # a body that stalls holds its connection: http_guard.py
                async with asyncio.timeout(http_guard.BODY_IDLE_TIMEOUT_S):
                    chunk = await anext(stream)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise HttpError(408, f"the request body stalled (no byte for "
                                     f"{http_guard.BODY_IDLE_TIMEOUT_S:g} s)") from None
            size += len(chunk)
            if size > self.max_body_bytes:
                raise self._too_large()
            chunks.append(chunk)
        data = b"".join(chunks)
        if len(data) > THREAD_BODY_BYTES:  # the loop keeps some turns for the other streams meanwhile
            body = await asyncio.to_thread(schema.model_validate_json, data)
        else:
            body = schema.model_validate_json(data)
        model = getattr(body, "model", None)
        if model not in self.model_names:
            raise HttpError(404, f"the model {model!r} does not exist (this server serves "
                                 f"{self.model_name!r})", "model", "model_not_found")
        return body

    async def _completions(self, request: Request) -> Response:
        body: CompletionRequest = await self._body(request, CompletionRequest)
        most = self.max_requests_per_client
        if most is not None and len(body.prompts()) > most:  # each prompt is a request: never admitted
            raise HttpError(400, f"prompt: {len(body.prompts())} prompts; this server takes at most {most} "
                                 "requests of one client at once (--max-requests-per-client)", "prompt")
        exchange = Exchange("cmpl", "text_completion", self.model_name, body, self.text, chat=False)
        return await self._answer(request, exchange, completion_requests(body))

    async def _chat(self, request: Request) -> Response:
        body: ChatCompletionRequest = await self._body(request, ChatCompletionRequest)
        exchange = Exchange("chatcmpl", "chat.completion", self.model_name, body, self.text, chat=True)
        # rendering and tokenizing a long chat on a worker thread: the other streams keep flowing
        generate = await asyncio.to_thread(chat_request, body, self.text, self.max_context_tokens)
        try:
            return await self._answer(request, exchange, [generate])
        except ApiError as exc:  # the scheduler judged the rendered chat's tokens: its prompt is messages
            err = http_error(exc)
            if err.param != "prompt":
                raise
            raise HttpError(err.status, f"messages: {err.message.removeprefix('prompt: ')} (the chat as "
                                        "its template renders it)", "messages") from None

    async def _answer(self, request: Request, exchange: Exchange, generate_requests: list) -> Response:
        calls: list[LinkCall] = []
        client = http_client(request)
        try:
            for generate_request in generate_requests:
                try:
                    calls.append(LinkCall(self.link, generate_request, client=client))
                except ResourceExhaustedError as exc:  # over the link's message size: not "retry later"
                    raise HttpError(413, str(exc)) from None
                self._calls.add(calls[-1])
            if exchange.body.stream:
                # each call queued by the scheduler before the headers: a refused request is a 400, not
                # a stream; the headers then go out at once, not at the first token (seconds of queueing)
                await asyncio.gather(*(call.accepted() for call in calls))
                return SSEResponse(sse_events(exchange, calls), on_close=[lambda: self._close(calls)])
            return JSONResponse(await _unless_disconnected(request, collect(exchange, calls)))
        except BaseException:
            self._close(calls)
            raise
        finally:
            if not exchange.body.stream:
                self._close(calls)

    def _close(self, calls: list[LinkCall]) -> None:
        for call in calls:
            call.close()
            self._calls.discard(call)

    def cut_off(self, reason: str) -> int:
        """Ends every call in flight with UNAVAILABLE saying `reason` (their requests cancelled): a
        stream then sends an error event and [DONE], a whole answer is a 503. Returns how many."""
        calls, self._calls = list(self._calls), set()
        for call in calls:
            call.cut(reason)
        return len(calls)

    async def _models(self, request: Request) -> Response:
        card = ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_context_tokens)
        return JSONResponse(ModelList(data=[card]).model_dump())

    async def _health(self, request: Request) -> Response:
        if self.draining or not self.is_serving():
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def _metrics(self, request: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


def http_client(request: Request) -> str:
    """Who made an HTTP request, for the scheduler's per-client admission limit
    (--max-requests-per-client): its connection, as a gRPC client is its peer (one keep-alive
    connection is one client). Without it every HTTP client of a front-end would be one client."""
    peer = request.client
    return f"http:{peer.host}:{peer.port}" if peer is not None else ""


async def _unless_disconnected(request: Request, work) -> Any:
    """Awaits `work`; cancels it when the client goes away first (its requests are then aborted)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise HttpError(499, "the client closed the connection")
    return task.result()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the front-end handles SIGTERM / SIGINT itself (drain)
        yield


async def start_http_server(
    api: HttpApi, host: str, port: int, tls_cert_file: str | None = None, tls_key_file: str | None = None,
    reuse_port: bool = False,
) -> tuple[uvicorn.Server, int, asyncio.Future]:
    """Serves `api` until the returned server's `should_exit` is set; returns it, its port (the one
    picked for port 0) and the task that serves. `reuse_port`: the listening socket sets SO_REUSEPORT
    (other front-ends of the scheduler listen on the same port)."""
    config = uvicorn.Config(api.app, host=host, port=port, lifespan="off", log_level="warning",
                            access_log=False, ssl_certfile=tls_cert_file, ssl_keyfile=tls_key_file,
                            backlog=4096, timeout_keep_alive=60, http=http_guard.http_protocol())
    server = _Server(config)
    sockets = None
    if reuse_port:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            sock.close()
            raise OSError(f"the HTTP API cannot listen on {host}:{port}: {err}") from err
        sockets = [sock]

    async def serve() -> None:
        try:
            await server.serve(sockets=sockets)
        except SystemExit:  # uvicorn exits when it cannot bind (it logged the OS's error); out of a task,
            # a SystemExit would leave the event loop itself
            raise OSError(f"the HTTP API cannot listen on {host}:{port} (the error above: the port in use "
                          "by another server, an address not this machine's, or a port below 1024)") from None

    task = asyncio.ensure_future(serve())
    while not server.started:
        if task.done():
            task.result()  # raises why
            raise RuntimeError(f"the HTTP API could not listen on {host}:{port}")
        await asyncio.sleep(0.01)
    return server, server.servers[0].sockets[0].getsockname()[1], task


class HttpService:
    """The running HTTP API: `stop` drains it (503 for new calls, calls in flight get `grace_s`)."""

    def __init__(self, api: HttpApi, server: uvicorn.Server, port: int, task: asyncio.Future):
        self.api, self.server, self.port, self.task = api, server, port, task

    async def stop(self, grace_s: float) -> None:
        self.api.draining = True
        deadline = time.monotonic() + grace_s
        while self.api.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.api.num_in_flight:  # past the grace period: each client told so, not its connection cut
            num = self.api.cut_off("the server stopped before this request finished (its drain grace "
                                   "period ended); retry elsewhere")
            _log.info("drain grace period over: %d requests in flight ended with UNAVAILABLE", num)
            flushed = time.monotonic() + CUT_OFF_FLUSH_S
            while self.api.num_in_flight and time.monotonic() < flushed:
                await asyncio.sleep(0.02)
        self.server.should_exit = True
        self.server.force_exit = True  # what is left past the grace period is cut off
        await self.task


class _Link(StreamLink, Protocol):
    generation: Any  # the scheduler's Generation stub
    metadata: tuple
    connected: asyncio.Event
    scheduler_serving: bool


async def start_http_api(
    link: _Link, host: str, port: int, model_dir: str | None, chat_template_file: str | None,
    tls_cert_file: str | None, tls_key_file: str | None, auth_token: str | None, reuse_port: bool = False,
) -> HttpService:
    """Serves the HTTP API through `link` (the front-end's link to the scheduler, connected); prints
    where. The model's name and limits come from the scheduler; its text from `model_dir`.
    `reuse_port`: other front-ends serve the same port (SO_REUSEPORT)."""
    info = await link.generation.GetModelInfo(
        generation_pb2.GetModelInfoRequest(), metadata=link.metadata, timeout=30.0
    )
    max_context_tokens = min(info.max_model_len, info.num_gpu_blocks * info.block_size or info.max_model_len)
    reported = ChatTemplate(info.chat_template, info.bos_token, info.eos_token)
    text = ModelText.with_override(reported, model_dir, chat_template_file)
    api = HttpApi(link, info.model_name, max_context_tokens, text, auth_token,
                  lambda: link.connected.is_set() and link.scheduler_serving,
                  max_requests_per_client=info.max_requests_per_client or None)
    server, bound, task = await start_http_server(api, host, port, tls_cert_file, tls_key_file, reuse_port)
    scheme = "https" if tls_cert_file else "http"
    print(f"pagedserve OpenAI-compatible HTTP API: {scheme}://{host}:{bound}/v1", flush=True)
    return HttpService(api, server, bound, task)

