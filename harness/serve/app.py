"""The HTTP routes of `harness serve` (FastAPI): /health, /v1/models, /v1/completions (vLLM dialect),
/generate (SGLang dialect), /metrics (Prometheus text, vLLM's metric names).

A client that goes away before its answer (it disconnects while waiting, or while still sending its
body) is one log line, and its request is cancelled: the engine loop drops it (harness/serve/lockstep.py).
A request naming a model this server does not serve is a 404 in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.requests import ClientDisconnect

from harness.serve.dialects import (
    BadRequest,
    Limits,
    Vocabulary,
    completions_response,
    generate_response,
    parse_completions,
    parse_generate,
)
from harness.serve.lockstep import Pending
from harness.serve.protocol import Completion, CompletionResult

DISCONNECT_POLL_S = 0.2  # how often a waiting handler checks that its client is still there
CLIENT_GONE = 499  # the status logged for a request whose client left (nginx's "client closed request")
log = logging.getLogger("uvicorn.error")  # the server log's own lines, as uvicorn writes them


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class UnknownModel(Exception):
    """A request named a model this server does not serve."""

    def __init__(self, asked: str, served: str) -> None:
        super().__init__(f"The model `{asked}` does not exist; this server serves `{served}`.")
        self.asked = asked


@dataclass
class Metrics:
    """Counters exported at /metrics under vLLM's names (spec decode counters as vLLM v1 names them)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests: int = 0
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)  # accepted tokens per draft position 0..k-1
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, batch: list[Completion], results: list[CompletionResult]) -> None:
        with self.lock:
            self.requests += len(batch)
            self.prompt_tokens += sum(len(c.prompt) for c in batch)
            self.generation_tokens += sum(len(r.tokens) for r in results)
            self.spec_drafts += sum(r.spec_steps for r in results)
            self.spec_draft_tokens += sum(r.spec_draft_tokens for r in results)
            self.spec_accepted_tokens += sum(r.spec_accepted_tokens for r in results)
            for r in results:  # a verify step that accepted a drafts accepted positions 0..a-1
                k = r.spec_draft_tokens // r.spec_steps if r.spec_steps else 0
                self.spec_accepted_per_pos += [0] * (k - len(self.spec_accepted_per_pos))
                for a in r.accepted_per_step:
                    for p in range(a):
                        self.spec_accepted_per_pos[p] += 1

    def render(self, model: str) -> str:
        label = f'{{model_name="{model}"}}'
        rows = [("vllm:prompt_tokens_total", self.prompt_tokens),
                ("vllm:generation_tokens_total", self.generation_tokens),
                ("vllm:request_success_total", self.requests),
                ("vllm:spec_decode_num_drafts_total", self.spec_drafts),
                ("vllm:spec_decode_num_draft_tokens_total", self.spec_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens_total", self.spec_accepted_tokens)]
        per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        with self.lock:
            text = "".join(f"# TYPE {name} counter\n{name}{label} {value}\n" for name, value in rows)
            if self.spec_accepted_per_pos:  # as vLLM v1 exports them: one sample per position label
                text += f"# TYPE {per_pos} counter\n" + "".join(
                    f'{per_pos}{{model_name="{model}",position="{p}"}} {n}\n'
                    for p, n in enumerate(self.spec_accepted_per_pos))
            return text


def _error(message: str, status: int) -> JSONResponse:
    kind = "BadRequestError" if status == 400 else "InternalServerError"
    return JSONResponse({"object": "error", "message": message, "type": kind, "code": status}, status_code=status)


def _peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "?"


def build_app(submit: Callable[[Pending], None], vocab: Vocabulary, limits: Limits, model: str,
              info: dict[str, Any], kv_store: Path | None = None, greedy_only: str = "") -> FastAPI:
    """The app; `submit` hands a Pending to the engine loop, which completes its future. `kv_store`: a P/D decode
    server's store folder, where each request's namespace must exist (the prefill server made it). `greedy_only`:
    why this server cannot sample (a speculative server, a P/D side), refusing sampled requests with a 400."""
    app = FastAPI(title="harness serve")
    metrics = Metrics()
    created = int(time.time())

    async def run(request: Request, batch: list[Completion]) -> list[CompletionResult]:
        """The batch's results from the engine loop; a client that disconnects meanwhile cancels it."""
        pending = Pending(batch)
        submit(pending)
        waiter = asyncio.wrap_future(pending.future)
        try:
            while not waiter.done():
                await asyncio.wait({waiter}, timeout=DISCONNECT_POLL_S)
                if not waiter.done() and await request.is_disconnected():
                    raise ClientGone()
            results = waiter.result()
        finally:
            if not waiter.done():  # client gone or this task cancelled: cancels pending.future too
                waiter.cancel()
        metrics.add(batch, results)
        return results

    def check_model(body: dict[str, Any]) -> None:
        asked = body.get("model")
        if asked is not None and asked != model:
            raise UnknownModel(str(asked), model)

    def check_namespaces(batch: list[Completion]) -> None:
        """A P/D generation naming a namespace the prefill server never filled is the client's error (400), not a
        silent recompute: the client asked for the prefill server's KV and would be answered without it."""
        if kv_store is None:
            return
        for c in batch:
            if c.kv is not None and not (kv_store / c.kv.namespace).is_dir():
                raise BadRequest(f"kv_transfer_params.namespace={c.kv.namespace!r} is not in this decode server's KV "
                                 f"store {kv_store}: no prefill server has sent KV under it; send the prompts to the "
                                 f"prefill server first, with the same namespace")

    def check_sampling(batch: list[Completion]) -> None:
        if greedy_only and any(c.sampling is not None for c in batch):
            raise BadRequest(f"temperature > 0: {greedy_only} decodes greedily; send temperature 0")

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise BadRequest(f"request body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(str(exc), 400)

    @app.exception_handler(UnknownModel)
    async def unknown_model(_: Request, exc: UnknownModel) -> JSONResponse:
        return JSONResponse({"error": {"message": str(exc), "type": "NotFoundError", "param": "model", "code": 404}},
                            status_code=404)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, _: ClientGone) -> Response:
        log.info("client %s disconnected before the answer to %s %s: request cancelled", _peer(request),
                 request.method, request.url.path)
        return Response(status_code=CLIENT_GONE)

    @app.exception_handler(ClientDisconnect)
    async def client_disconnect(request: Request, _: ClientDisconnect) -> Response:
        log.info("client %s disconnected while sending the body of %s %s: request dropped", _peer(request),
                 request.method, request.url.path)
        return Response(status_code=CLIENT_GONE)

    @app.exception_handler(RuntimeError)
    async def engine_error(_: Request, exc: RuntimeError) -> JSONResponse:
        return _error(f"engine error: {exc}", 500)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                            "owned_by": "harness", "max_model_len": limits.max_model_len}]}

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return info

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(model))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await body_of(request)
        if body.get("stream"):
            raise BadRequest("stream=true is not supported")
        check_model(body)
        batch = parse_completions(body, vocab, limits)
        check_sampling(batch)
        check_namespaces(batch)
        return completions_response(body, batch, await run(request, batch), vocab, model)

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body = await body_of(request)
        check_model(body)  # SGLang's /generate has no model field; one that names another model is refused
        batch, batched = parse_generate(body, vocab, limits)
        check_sampling(batch)
        check_namespaces(batch)
        return generate_response(body, batch, await run(request, batch), vocab, batched)

    return app
