"""The FastAPI app: OpenAI endpoints, /health and /metrics over an AsyncEngine.

Every failure a client can cause is answered as OpenAI-shaped JSON with its
status (400 bad input, 401 key, 404 model, 413 body too large, 429 full, 503
not ready); nothing a request sends can take the server down, and no
internal exception text reaches a client (the log has it). A request whose
client goes away is aborted in the engine, which frees its KV blocks.

The event loop only moves bytes: the body is read under --max_request_bytes
(refused by its Content-Length, or as soon as it streams past the limit),
and parsing, tokenising and detokenising run in worker threads, so /health
and running streams keep flowing while a large prompt is handled.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from mtp_runtime.engine.detokenizer import IncrementalText

from .args import DEFAULT_MAX_REQUEST_BYTES
from .async_engine import AsyncEngine, EngineFailure, EngineNotReadyError, QueueFullError, RequestAborted
from .chat_template import ChatTemplateError
from .metrics import CONTENT_TYPE_LATEST
from .openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    lone_surrogate_error,
    may_hold_lone_surrogate,
    models_body,
    new_id,
    usage_chunk,
    validation_error_to_api_error,
)
from .request_builder import RequestBuilder
from .sse import SSE_DONE, SSE_MEDIA_TYPE, sse_event

log = logging.getLogger("mtp.serve")

# Non-streamed requests look for a vanished client this often while they wait.
_DISCONNECT_POLL_S = 0.5
# What a client is told when the engine broke under its request; the log has the exception.
_ENGINE_FAILED = "the engine failed while running this request; see the server log"


class _AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: nothing a client sent can make encoding fail."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(err: APIError) -> JSONResponse:
    return _AsciiJSONResponse(err.body(), status_code=err.status, headers=err.headers)


def text_worker_count() -> int:
    return min(4, os.cpu_count() or 1)


async def read_body(request: Request, limit: int) -> bytearray:
    """The request body, refused with 413 once it is known to exceed `limit` bytes.

    A too-large Content-Length is refused before a byte is read; a body that
    streams past the limit is refused at that chunk. uvicorn then discards
    the rest as it arrives, so memory never holds more than the limit.
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, f"Content-Length: {declared[:40]!r} is not a byte count", code="invalid_request")
        if int(declared) > limit:
            raise _too_large(f"{int(declared)} bytes", limit)
    # Grown as bytes arrive (never ahead of them: a client that stalls holds only what it sent),
    # each chunk freed once appended.
    body = bytearray()
    async for chunk in _chunks(request):
        body += chunk
        if len(body) > limit:
            raise _too_large(f"more than {limit} bytes", limit)
    return body


async def _chunks(request: Request):
    try:
        async for chunk in request.stream():
            yield chunk
    except ClientDisconnect:
        raise APIError(499, "client disconnected while sending the body", code="client_closed") from None


def _too_large(size: str, limit: int) -> APIError:
    return APIError(413, f"request body: {size} is over this server's limit of {limit} bytes "
                         "(mtp serve --max_request_bytes)", code="request_too_large")


def parse_body(raw: bytearray, model_cls):
    """JSON bytes -> a validated request model, or an APIError (400) naming what is wrong.

    `raw` is emptied once decoded, so a large body is held at most twice
    (its bytes while they are decoded, then its text while it is parsed).
    """
    try:
        text = raw.decode("utf-8-sig")  # RFC 8259: UTF-8; a byte order mark is ignored, as json.loads does
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid JSON: not UTF-8 ({exc.reason} at byte {exc.start})",
                       code="invalid_json") from None
    may_hold_surrogates = may_hold_lone_surrogate(raw)
    raw.clear()
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, and ints of over 4300 digits
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise APIError(400, f"request body is not valid JSON: {reason}", code="invalid_json") from None
    del text
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    surrogate = lone_surrogate_error(body) if may_hold_surrogates else None
    if surrogate is not None:
        raise surrogate
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error_to_api_error(exc) from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply", code="invalid_json") from None


def create_app(engine: AsyncEngine, builder: RequestBuilder, served_model_name: str, model_path: str,
               api_key: str | None, health_extra: dict | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    app = FastAPI(title="mtp serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.draining = False
    # Parsing, tokenising and detokenising: blocking work kept off the event loop.
    text_pool = ThreadPoolExecutor(max_workers=text_worker_count(), thread_name_prefix="mtp-text")
    app.state.text_pool = text_pool

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(text_pool, fn, *args)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail), type_="invalid_request_error"))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unexpected error")
        return error_response(APIError(500, "internal server error; see the server log", type_="server_error"))

    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(token.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key: send Authorization: Bearer <key>",
                           type_="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(404, f"model: {name!r} does not exist; this server serves {served_model_name!r}",
                           type_="invalid_request_error", param="model", code="model_not_found")

    async def parse(request: Request, model_cls):
        check_api_key(request)
        raw = await read_body(request, max_request_bytes)
        parsed = await off_loop(parse_body, raw, model_cls)
        check_model(parsed.model)
        return parsed

    def submit(request_id: str, prompt_ids: list[int], params) -> asyncio.Queue:
        if app.state.draining:
            raise APIError(503, "the server is shutting down", type_="server_error", code="shutting_down")
        try:
            return engine.add_request(request_id, prompt_ids, params)
        except QueueFullError as exc:
            raise APIError(429, str(exc), type_="rate_limit_error", code="queue_full") from None
        except EngineNotReadyError as exc:
            raise APIError(503, str(exc), type_="server_error", code="not_ready") from None
        except ValueError as exc:  # the engine's own validation, e.g. a request it can never schedule
            raise APIError(400, f"prompt: {exc}", param="prompt", code="invalid_request") from None

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        prompt_ids = await off_loop(builder.completion_prompt_ids, req.prompt)
        params = builder.sampling_params(req, len(prompt_ids), req.max_tokens, prompt_param="prompt")
        request_id = new_id("cmpl")
        outputs = submit(request_id, prompt_ids, params)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            events = _stream(engine, request_id, outputs, served_model_name, "completion", include_usage, off_loop)
            return StreamingResponse(events, media_type=SSE_MEDIA_TYPE)
        out = await _collect(engine, request, request_id, outputs)
        text = await off_loop(_decoded_text, out)
        return completion_body(request_id, served_model_name, text, out.finish_reason,
                               len(out.prompt_token_ids), len(out.token_ids))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await parse(request, ChatCompletionRequest)
        try:
            prompt_ids = await off_loop(builder.chat_prompt_ids, req)
        except ChatTemplateError as exc:
            raise APIError(400, f"messages: {exc}", param="messages", code="chat_template_error") from None
        params = builder.sampling_params(req, len(prompt_ids), req.requested_max_tokens(), prompt_param="messages")
        request_id = new_id("chatcmpl")
        outputs = submit(request_id, prompt_ids, params)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            events = _stream(engine, request_id, outputs, served_model_name, "chat", include_usage, off_loop)
            return StreamingResponse(events, media_type=SSE_MEDIA_TYPE)
        out = await _collect(engine, request, request_id, outputs)
        text = await off_loop(_decoded_text, out)
        return chat_body(request_id, served_model_name, text, out.finish_reason,
                         len(out.prompt_token_ids), len(out.token_ids))

    @app.get("/v1/models")
    async def models(request: Request):
        check_api_key(request)
        return models_body(served_model_name, model_path)

    @app.get("/health")
    async def health():
        status, body = engine.node_state.health()
        body.update(health_extra or {})
        body.update(engine.health_stats())
        if app.state.draining:
            status, body["state"] = 503, "draining"
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _decoded_text(out) -> str:
    return out.text  # RequestOutput decodes its tokens on first access


def _text_delta(text: str, sent: int, finished: bool) -> str:
    # A trailing U+FFFD is half of a multi-byte character; wait for the rest unless done.
    end = len(text) if finished else len(text.rstrip("\ufffd"))
    return text[sent:end] if end > sent else ""


async def _collect(engine: AsyncEngine, request: Request, request_id: str, outputs: asyncio.Queue):
    finished = False
    try:
        while True:
            try:
                item = await asyncio.wait_for(outputs.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise APIError(499, "client disconnected", code="client_closed") from None
                continue
            if isinstance(item, EngineFailure):
                finished = True
                raise APIError(500, _ENGINE_FAILED, type_="server_error", code="engine_error")
            if isinstance(item, RequestAborted):
                finished = True
                raise APIError(503, item.message, type_="server_error", code="aborted")
            if item.finished:
                finished = True
                return item
    finally:
        if not finished:
            engine.abort_request(request_id)


async def _stream(engine: AsyncEngine, request_id: str, outputs: asyncio.Queue, model: str, kind: str,
                  include_usage: bool, off_loop):
    finished = False
    sent = 0
    text: IncrementalText | None = None  # the output's text so far, decoded as it grows
    try:
        if kind == "chat":
            yield sse_event(chat_chunk(request_id, model, {"role": "assistant", "content": ""}, None))
        while True:
            item = await outputs.get()
            if isinstance(item, EngineFailure):
                finished = True
                yield sse_event({"error": APIError(500, _ENGINE_FAILED, type_="server_error").body()["error"]})
                yield SSE_DONE
                return
            if isinstance(item, RequestAborted):  # cut short at shutdown: end the stream properly
                finished = True
                if kind == "chat":
                    yield sse_event(chat_chunk(request_id, model, {}, "abort"))
                else:
                    yield sse_event(completion_chunk(request_id, model, "", "abort"))
                yield SSE_DONE
                return
            if item.engine_text:  # stop strings: the engine's text, cut at the stop string
                delta = _text_delta(item.text, sent, item.finished)
                sent += len(delta)
            elif item.new_token_ids or item.finished:  # decode the new tokens only
                text = text or IncrementalText(item.tokenizer)
                delta = await off_loop(text.update, item.token_ids, item.finished)
            else:
                delta = ""
            reason = item.finish_reason if item.finished else None
            if delta or item.finished or item.new_token_ids:
                if kind == "chat":
                    yield sse_event(chat_chunk(request_id, model, {"content": delta} if delta else {}, reason))
                else:
                    yield sse_event(completion_chunk(request_id, model, delta, reason))
            if item.finished:
                finished = True
                if include_usage:
                    object_ = "chat.completion.chunk" if kind == "chat" else "text_completion"
                    yield sse_event(usage_chunk(request_id, model, object_, len(item.prompt_token_ids),
                                                len(item.token_ids)))
                yield SSE_DONE
                return
    finally:
        if not finished:  # client went away or the server is cancelling us: free the blocks
            engine.abort_request(request_id)
