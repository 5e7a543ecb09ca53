"""The HTTP layer: FastAPI routes of the OpenAI API over the decoding worker.

A request is validated (pydantic, `schemas.py`), its model resolved and its prompt encoded
and checked against the context before it takes a queue slot; every refusal is a 4xx in
OpenAI's error shape. A streamed response starts once the first text is decoded, so an error
found while decoding starts is still a status code. A client that goes away cancels its job
(waiting or decoding), which frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtpkit.core.errors import MtpkitError
from mtpkit.serve.metrics import CONTENT_TYPE, RequestTimer, ServeMetrics
from mtpkit.serve.prompts import build_request
from mtpkit.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    Outcome,
    ResponseIds,
    error_body,
    model_list,
)
from mtpkit.serve.settings import ServeSettings
from mtpkit.serve.worker import Failed, Job, QueueFull, ShuttingDown, Worker
from mtpkit.speculative.session import TokenEvent

# How often a waiting request checks that its client is still there (seconds).
DISCONNECT_POLL = 0.5
RETRY_AFTER = "1"  # seconds, on a full queue


class ApiError(Exception):
    """A refusal with its status, in OpenAI's error shape."""

    def __init__(
        self, status: int, message: str, code: str | None = None, param: str | None = None,
        kind: str = "invalid_request_error", headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.kind, self.headers = kind, headers

    def response(self) -> JSONResponse:
        body = error_body(self.message, self.kind, self.param, self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def create_app(settings: ServeSettings, worker: Worker) -> FastAPI:
    app = FastAPI(title="mtpkit serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(
        CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
        allow_headers=["*"],
    )  # fmt: skip
    _add_error_handlers(app)
    served = Served(settings, worker, ServeMetrics(worker, settings.model))
    auth = [Depends(_key_check(settings.api_key))] if settings.api_key else []

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "decoding": worker.decoding,
            "queued": worker.jobs.qsize(),
            "finished": worker.finished,
            "cancelled": worker.cancelled,
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return model_list(settings.model, served.created)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatCompletionRequest, request: HttpRequest) -> Response:
        return await served.complete(body, request, chat=True)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: HttpRequest) -> Response:
        return await served.complete(body, request, chat=False)

    return app


class Served:
    """The routes' shared work: resolve, encode, queue, answer."""

    def __init__(self, settings: ServeSettings, worker: Worker, metrics: ServeMetrics) -> None:
        self.settings, self.worker, self.metrics = settings, worker, metrics
        self.created = int(time.time())
        path = Path(settings.model).expanduser()
        self.served_path = path.resolve() if path.is_dir() else None
        self.names = {settings.model, "default_model", path.name}
        # Prompts are encoded on one thread of their own, beside the decoding thread: a
        # tokenizer is not promised to be safe under many threads at once.
        self.encoder = ThreadPoolExecutor(1, thread_name_prefix="mtpkit-encode")

    def resolve_model(self, name: str | None) -> str | None:
        """None for the served model; another model's directory only with
        --allow-model-paths (a request never names files otherwise)."""
        if not name or name in self.names:
            return None
        if not self.settings.allow_model_paths:
            raise ApiError(
                404, f"the model `{name}` does not exist: this server serves "
                f"`{self.settings.model}`", "model_not_found", "model",
            )  # fmt: skip
        path = Path(name).expanduser()
        if not path.is_dir():
            raise ApiError(404, f"no model directory at `{name}`", "model_not_found", "model")
        resolved = path.resolve()
        return None if resolved == self.served_path else str(resolved)

    async def complete(
        self, body: ChatCompletionRequest | CompletionRequest, request: HttpRequest, chat: bool
    ) -> Response:
        model = self.resolve_model(body.model)
        timer = self.metrics.timer()
        loop = asyncio.get_running_loop()
        if model is None:  # encoded and checked now, before it takes a slot
            engine = self.worker.served_engine
            try:
                encode = partial(build_request, engine, body, self.settings)
                built = await loop.run_in_executor(self.encoder, encode)
            except MtpkitError as e:
                raise ApiError(400, str(e), _code(e)) from None
            job = Job(lambda _engine: built, None, loop)
        else:
            job = Job(partial(build_request, body=body, settings=self.settings), model, loop)
        try:
            self.worker.submit(job)
        except QueueFull as e:
            raise ApiError(
                503, str(e), "queue_full", kind="server_error",
                headers={"Retry-After": RETRY_AFTER},
            ) from None  # fmt: skip
        except ShuttingDown as e:
            raise ApiError(503, str(e), "shutting_down", kind="server_error") from None
        ids = ResponseIds(chat, body.model or self.settings.model)
        watcher = asyncio.create_task(_cancel_when_gone(job, request))
        try:
            first = await job.events.get()
            if isinstance(first, Failed):
                raise _failure(first)
            timer.token()
            if body.stream:  # from here on the response notices a client gone itself
                return JobStream(job, _sse(job, ids, first, body.include_usage, chat, timer))
            item = first
            while not isinstance(item, Outcome):
                item = await job.events.get()
                if isinstance(item, Failed):
                    raise _failure(item)
            timer.done(item)
            return JSONResponse(ids.complete(item))
        finally:
            watcher.cancel()


class JobStream(StreamingResponse):
    """A job's server-sent events; however the response ends (done, the client gone before
    or during the stream, the server stopping), the job is cancelled (a no-op once done)."""

    def __init__(self, job: Job, events: AsyncIterator[str]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


async def _cancel_when_gone(job: Job, request: HttpRequest) -> None:
    """Cancel the job (waiting or decoding) once its client has closed the connection; the
    worker then ends it, and the answer goes nowhere."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL)
    job.cancel()


async def _sse(
    job: Job, ids: ResponseIds, first: TokenEvent | Outcome, include_usage: bool, chat: bool,
    timer: RequestTimer,
) -> AsyncIterator[str]:  # fmt: skip
    """Server-sent events: chunks of text, the finish chunk (with the mtp object), the usage
    chunk when asked for, `[DONE]`; an error while decoding is an `error` event."""
    try:
        if chat:
            yield _event(ids.role_chunk())
        item: TokenEvent | Outcome | Failed = first
        while True:
            if isinstance(item, TokenEvent):
                yield _event(ids.chunk(item.text))
            elif isinstance(item, Outcome):
                timer.done(item)
                yield _event({**ids.chunk(None, item.finish_reason), **item.extras()})
                if include_usage:
                    yield _event(ids.usage_chunk(item))
                break
            else:
                kind = "server_error" if item.status >= 500 else "invalid_request_error"
                yield _event(error_body(item.message, kind, code=item.code))
                break
            item = await job.events.get()
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # the client left mid-stream: stop decoding, free the slot (also JobStream)


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _failure(failed: Failed) -> ApiError:
    kind = "server_error" if failed.status >= 500 else "invalid_request_error"
    return ApiError(failed.status, failed.message, failed.code, kind=kind)


def _code(error: MtpkitError) -> str | None:
    from mtpkit.speculative.session import PromptTooLong

    return "context_length_exceeded" if isinstance(error, PromptTooLong) else None


def _key_check(key: str) -> Callable[[HttpRequest], Awaitable[None]]:
    """`--api-key`: every /v1 route needs `Authorization: Bearer KEY`."""

    async def check(request: HttpRequest) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), key):
            message = "invalid or missing API key (send Authorization: Bearer KEY)"
            raise ApiError(401, message, "invalid_api_key")

    return check


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: HttpRequest, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: HttpRequest, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            message, param = "the body is not valid JSON", None
        text = f"{param}: {message}" if param else message
        return ApiError(400, text, "invalid_value", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: HttpRequest, error: HTTPException) -> JSONResponse:
        return ApiError(error.status_code, str(error.detail)).response()

    @app.exception_handler(Exception)
    async def unexpected(_request: HttpRequest, error: Exception) -> JSONResponse:
        body = error_body(f"internal error: {type(error).__name__}", "server_error")
        return JSONResponse(body, status_code=500)
