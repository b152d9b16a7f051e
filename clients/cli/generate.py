"""`pagedserve generate`: send one request and stream its text to the terminal (or print JSON)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import grpc

from clients.client import Client
from clients.results import GenerationResult

BANNER_SETTLE_S = 1.0  # after a server became ready: its launcher's banner lines come out first


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated integers, e.g. 1,2,3") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-ids", type=_token_ids, help="prompt token ids, e.g. 1,2,3")
    prompt.add_argument("--chat", metavar="MESSAGE",
                        help="a user message, sent as a prompt rendered with the model's chat template")
    parser.add_argument("--server", default="localhost:50051", help="HOST:PORT of the Generation API")
    parser.add_argument("--tls-ca-file", default=None,
                        help="connect over TLS, trusting this CA certificate (PEM; '' = system roots)")
    parser.add_argument("--auth-token-file", default=None,
                        help="bearer token for a server that requires one (default: $PAGEDSERVE_AUTH_TOKEN)")
    parser.add_argument("--max-tokens", type=int, default=None, help="output tokens (None: the server's)")
    parser.add_argument("--n", type=int, default=None, help="parallel samples, each streamed as [i]")
    parser.add_argument("--beam-width", type=int, default=None, help="beam search (beams printed at the end)")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (server default 1.0)")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling (None: the server's)")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables")
    parser.add_argument("--seed", type=int, default=None, help="reproducible sampling")
    parser.add_argument("--ignore-eos", action="store_true", help="generate all max_tokens")
    parser.add_argument("--stop", nargs="+", default=[], help="stop strings")
    parser.add_argument("--stop-token-ids", type=_token_ids, default=[], help="e.g. 2,13")
    parser.add_argument("--logprobs", type=int, default=None,
                        help="print each token's logprob and this many top alternatives (in --json too)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                        help="wait up to this long for the server to be ready (e.g. right after `serve &`)")


def run(args: argparse.Namespace) -> int:
    params = dict(
        max_tokens=args.max_tokens, n=args.n, beam_width=args.beam_width, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos, stop=args.stop,
        stop_token_ids=args.stop_token_ids, logprobs=args.logprobs,
    )
    prompt = args.prompt if args.prompt is not None else args.prompt_ids
    result = GenerationResult()
    connection = dict(tls_ca_file=args.tls_ca_file, auth_token=_read_token(args.auth_token_file))
    if args.wait > 0:
        ready = wait_ready(args.server, args.wait, **connection)
        if ready is None:
            print(f"pagedserve generate: {args.server} not ready after {args.wait:.0f} s", file=sys.stderr)
            return 1
        if not ready:  # it just became ready: a launcher sharing this terminal prints its banner now
            time.sleep(BANNER_SETTLE_S)
    printer = _Printer(beams=(args.beam_width or 1) > 1, samples=args.n or 1)
    try:
        with Client(args.server, **connection) as client:
            if args.chat is not None:
                prompt = _chat_prompt(client, args.chat)
            for delta in client.stream(prompt, **params):
                result.add(delta)
                if not args.json:
                    printer.delta(delta)
    except grpc.RpcError as err:
        print(f"\npagedserve generate: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the call is cancelled (the server aborts the request)
        print("\npagedserve generate: interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result.to_json_dict(), ensure_ascii=False))
    else:
        printer.end(result)
    return 0


def _chat_prompt(client: Client, message: str) -> str:
    """One user message rendered with the chat template the server reports (GetModelInfo)."""
    from scheduler_svc.wire.chat_template import ChatTemplate

    info = client.model_info()
    template = ChatTemplate(info.chat_template, info.bos_token, info.eos_token)
    try:
        return template.render([{"role": "user", "content": message}], add_generation_prompt=True)
    except ValueError as err:
        raise SystemExit(f"pagedserve generate: --chat: {err} (use --prompt)") from None


def _read_token(path: str | None) -> str | None:
    return pathlib.Path(path).read_text().strip() if path else None


def wait_ready(target: str, timeout_s: float, **connection) -> bool | None:
    """Once the server answers GetModelInfo (it does so only after startup completed): True when it
    did at the first try, False when it became ready while waiting; None when it never did."""
    deadline = time.monotonic() + timeout_s
    first = True
    while time.monotonic() < deadline:
        try:
            with Client(target, timeout_s=2.0, retries=0, **connection) as client:
                client.model_info()
            return first
        except grpc.RpcError:
            first = False
            time.sleep(0.5)
    return None


class _Printer:
    """Streams the text as it comes: one output plainly; several (n > 1) each under an `[i]` tag,
    retagged whenever the output being printed changes. Beams arrive whole at the end. Logprobs,
    when asked for, follow the text (token id, logprob, top alternatives)."""

    def __init__(self, beams: bool, samples: int):
        self.beams, self.tagged = beams, samples > 1
        self.current: int | None = None

    def delta(self, delta) -> None:
        if self.beams:
            return
        for out in delta.outputs:
            if not out.text:
                continue
            if self.tagged and out.index != self.current:
                sys.stdout.write(("\n" if self.current is not None else "") + f"[{out.index}] ")
            self.current = out.index
            sys.stdout.write(out.text)
        sys.stdout.flush()

    def end(self, result: GenerationResult) -> None:
        if not result.outputs:
            print("\n[empty]")
            return
        if self.beams:
            for out in result.outputs:
                print(f"[{out.index}] ({out.finish_reason}) {out.text}")
        elif len(result.outputs) > 1:
            print("\n" + "  ".join(f"[{out.index}: {out.finish_reason}]" for out in result.outputs))
        else:
            print(f"\n[{result.outputs[0].finish_reason}]")
        for out in result.outputs:
            if out.logprobs:
                print(f"logprobs [{out.index}]: " + " ".join(_logprob_text(lp) for lp in out.logprobs))


def _logprob_text(lp) -> str:
    top = ",".join(f"{t}:{v:.3f}" for t, v in lp.top)
    return f"{lp.token_id}:{lp.logprob:.3f}" + (f"({top})" if top else "")
