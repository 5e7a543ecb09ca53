"""The HTTP layer: FastAPI routes of the OpenAI API over the decoding worker.

A request is validated (pydantic, `schemas.py`), its model resolved and its prompt encoded
and checked against the context before it takes a queue slot; every refusal is a 4xx in
OpenAI's error shape. A streamed response starts with the first text, or after
HEADERS_AFTER seconds without one (a long prompt prefilling, a request waiting its turn:
then `: keepalive` comments until the text comes), so an error found while decoding starts
is still a status code. A client that goes away cancels its job (waiting or decoding), which
frees its slot. Every route answers under `/v1` and without it, as mlx_lm.server's do.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtpkit.core.console import printable
from mtpkit.core.errors import MtpkitError
from mtpkit.serve.guard import Guard
from mtpkit.serve.metrics import CONTENT_TYPE, ServeMetrics
from mtpkit.serve.openapi import served_schema
from mtpkit.serve.oracle import OracleRefused
from mtpkit.serve.prompts import build_request
from mtpkit.serve.refusals import Refused
from mtpkit.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseIds,
    error_body,
    model_card,
    model_list,
)
from mtpkit.serve.settings import ServeSettings
from mtpkit.serve.stream import Shaping, collect, sse
from mtpkit.serve.worker import Failed, Job, QueueFull, ShuttingDown, Worker

# How often a waiting request checks that its client is still there (seconds).
DISCONNECT_POLL = 0.5
RETRY_AFTER = "1"  # seconds, on a full queue
MAX_NAME = 200  # characters of a client's model name a refusal repeats
HEADERS_AFTER = 1.0  # seconds a stream waits for its first text before it starts


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
    app = FastAPI(
        title="mtpkit serve", docs_url=None, redoc_url=None, openapi_url="/openapi.json"
    )
    app.openapi = lambda: served_schema(app)  # type: ignore[method-assign]
    # The key and the body's size before any body is read; CORS outside it, so that a
    # browser's preflight and a 401 both carry its headers.
    app.add_middleware(Guard, api_key=settings.api_key, max_body=settings.max_body)
    app.add_middleware(
        CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
        allow_headers=["*"],
    )  # fmt: skip
    _add_error_handlers(app)
    served = Served(settings, worker, ServeMetrics(worker, settings.model))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "decoding": worker.decoding,
            "queued": worker.jobs.qsize(),
            "finished": worker.finished,
            "cancelled": worker.cancelled,
        }

    @app.get("/metrics", include_in_schema=False)  # Prometheus text, not JSON
    async def metrics() -> Response:
        return Response(served.metrics.render(), media_type=CONTENT_TYPE)

    async def models() -> dict[str, Any]:
        return model_list(served.model_id, served.created)

    async def model(model_id: str) -> dict[str, Any]:
        if served.resolve_model(model_id) is not None:  # another model is not listed
            shown = printable(model_id[:MAX_NAME])
            raise ApiError(404, f"the model `{shown}` does not exist", "model_not_found")
        return model_card(served.model_id, served.created)

    async def chat(body: ChatCompletionRequest, request: HttpRequest) -> Response:
        return await served.complete(body, request, chat=True)

    async def completions(body: CompletionRequest, request: HttpRequest) -> Response:
        return await served.complete(body, request, chat=False)

    for prefix in ("/v1", ""):  # mlx_lm.server answers both
        app.get(f"{prefix}/models")(models)
        app.get(f"{prefix}/models/{{model_id:path}}")(model)
        app.post(f"{prefix}/chat/completions")(chat)
        app.post(f"{prefix}/completions")(completions)
    return app


class Served:
    """The routes' shared work: resolve, encode, queue, answer."""

    def __init__(self, settings: ServeSettings, worker: Worker, metrics: ServeMetrics) -> None:
        self.settings, self.worker, self.metrics = settings, worker, metrics
        self.created = int(time.time())
        path = Path(settings.model).expanduser()
        self.served_path = path.resolve() if path.is_dir() else None
        # The id /v1/models lists; a request may name the model by it, by --model as given,
        # by the directory's name or absolute path (mlx_lm.server's id), or "default_model".
        self.model_id = settings.served_model_name or settings.model
        self.names = {self.model_id, settings.model, "default_model", path.name}
        if self.served_path is not None:
            self.names.add(str(self.served_path))
        # Prompts are encoded on one thread of their own, beside the decoding thread: a
        # tokenizer is not promised to be safe under many threads at once.
        self.encoder = ThreadPoolExecutor(1, thread_name_prefix="mtpkit-encode")

    def resolve_model(self, name: str | None) -> str | None:
        """None for the served model; another model's directory under the root that
        --allow-model-paths names (a request never names files otherwise). Every refusal
        is the same 404, echoing only the client's own name (escaped): it tells nothing of
        which paths exist or where a link leads. Runs on the encoding thread."""
        if not name or name in self.names:
            return None
        shown = printable(name[:MAX_NAME]) + ("..." if len(name) > MAX_NAME else "")
        if self.served_path is not None and _same_path(name, self.served_path):
            return None  # mlx_lm.server's id: the directory's absolute path
        root = self.settings.allow_model_paths
        if root is None:
            raise ApiError(
                404, f"the model `{shown}` does not exist: this server serves "
                f"`{self.settings.model}`", "model_not_found", "model",
            )  # fmt: skip
        found = model_under(Path(root), name)
        if found is None:
            raise ApiError(
                404, f"no model directory `{shown}` under the server's model root",
                "model_not_found", "model",
            )  # fmt: skip
        return None if found == self.served_path else str(found)

    async def complete(
        self, body: ChatCompletionRequest | CompletionRequest, request: HttpRequest, chat: bool
    ) -> Response:
        timer = self.metrics.timer()
        loop = asyncio.get_running_loop()
        model = await loop.run_in_executor(self.encoder, self.resolve_model, body.model)
        if model is None:  # encoded and checked now, before it takes a slot
            engine = self.worker.served_engine
            try:
                encode = partial(build_request, engine, body, self.settings)
                built = await loop.run_in_executor(self.encoder, encode)
                if self.worker.oracle is not None:  # SYNTHETIC: greedy requests only
                    self.worker.oracle.check(built)
            except OracleRefused as e:
                raise ApiError(400, str(e), "unsupported_value", e.param) from None
            except MtpkitError as e:
                raise ApiError(400, str(e), _code(e)) from None
            job = Job(lambda _engine: built, None, loop, alone=built.one_stream)
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
        ids = ResponseIds(chat, body.model or self.model_id)
        tokenizer = self.worker.served_engine.m.tokenizer
        shaping = Shaping(tokenizer, body, chat, streaming=body.stream)
        watcher = asyncio.create_task(_cancel_when_gone(job, request))
        try:
            if body.stream:  # from here on the response notices a client gone itself
                first = await _first_event(job, HEADERS_AFTER)
                if isinstance(first, Failed):
                    raise _failure(first)
                return JobStream(job, sse(job, ids, first, body.include_usage, shaping, timer))
            answer = await collect(job, await job.events.get(), ids, shaping, timer)
            if isinstance(answer, Failed):
                raise _failure(answer)
            return JSONResponse(answer)
        finally:
            watcher.cancel()


def model_under(root: Path, name: str) -> Path | None:
    """The model directory `name` (relative to `root`, or absolute) names, resolved, when it
    lies under `root` (links followed) and holds a config.json; None otherwise, whatever
    the reason (missing, outside, not a model, a name no file system takes)."""
    try:
        base = root.resolve(strict=True)
        path = Path(name)
        found = (path if path.is_absolute() else base / path).resolve(strict=True)
        if found.is_relative_to(base) and (found / "config.json").is_file():
            return found
    except (OSError, ValueError, RuntimeError):  # too long, a NUL byte, a link loop
        pass
    return None


async def _first_event(job: Job, seconds: float) -> Any:
    """The job's first event, or None when none came within `seconds`."""
    try:
        return await asyncio.wait_for(job.events.get(), seconds)
    except asyncio.TimeoutError:
        return None


def _same_path(name: str, path: Path) -> bool:
    try:
        return Path(name).expanduser().resolve() == path
    except (OSError, RuntimeError, ValueError):
        return False


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


def _not_an_object(content_type: str | None) -> str:
    """What is wrong with a body that is not a JSON object, in the user's words."""
    if content_type and content_type.split(";")[0].strip().lower() == "application/json":
        return 'the body must be a JSON object, e.g. {"model": ..., "messages": [...]}'
    sent = f"`Content-Type: {content_type}`" if content_type else "no Content-Type"
    return (
        f"the body must be JSON sent with `Content-Type: application/json` (this request "
        f"has {sent}; with curl, add -H 'Content-Type: application/json')"
    )


def _failure(failed: Failed) -> ApiError:
    kind = "server_error" if failed.status >= 500 else "invalid_request_error"
    return ApiError(failed.status, failed.message, failed.code, kind=kind)


def _code(error: MtpkitError) -> str | None:
    from mtpkit.speculative.session import PromptTooLong

    return "context_length_exceeded" if isinstance(error, PromptTooLong) else None


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: HttpRequest, error: ApiError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HttpRequest, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        refused = first.get("ctx", {}).get("error")
        if isinstance(refused, Refused):  # the message names the field already
            return ApiError(400, str(refused), "unsupported_value", refused.param).response()
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            message, param = "the body is not valid JSON", None
        elif not loc and first.get("type") in ("model_attributes_type", "dict_type"):
            message = _not_an_object(request.headers.get("content-type"))
        text = f"{param}: {message}" if param else message
        return ApiError(400, text, "invalid_value", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: HttpRequest, error: HTTPException) -> JSONResponse:
        return ApiError(error.status_code, str(error.detail)).response()

    @app.exception_handler(Exception)
    async def unexpected(_request: HttpRequest, error: Exception) -> JSONResponse:
        body = error_body(f"internal error: {type(error).__name__}", "server_error")
        return JSONResponse(body, status_code=500)
