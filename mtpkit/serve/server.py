"""`serve`: load the model once, start the decoding thread, run uvicorn until SIGTERM or
Ctrl-C, then stop cleanly (the decode in flight is cancelled, waiting requests get a 503,
the process ends with status 0)."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from collections.abc import Iterator
from types import FrameType

import uvicorn

from mtpkit.core.errors import MtpkitError
from mtpkit.serve.settings import ServeSettings
from mtpkit.serve.worker import Worker
from mtpkit.speculative.proposers.choose import DrafterChoice
from mtpkit.speculative.session import Engine

log = logging.getLogger("mtpkit.serve")

# Seconds uvicorn waits for open responses after a signal before it cancels them (the
# worker cancels the decode at once, so this is only a backstop).
GRACEFUL_SHUTDOWN = 10
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def load_engine(settings: ServeSettings) -> Engine:
    """The served model with its drafter and prompt cache; --chat-template replaces the
    tokenizer's template (as mlx_lm.server's)."""
    drafter = DrafterChoice(
        settings.draft_model, settings.prompt_lookup, settings.prompt_lookup_min,
        settings.prompt_lookup_max,
    )  # fmt: skip
    engine = Engine.load(
        settings.model, drafter=drafter, mtp=settings.mtp,
        prompt_cache_size=settings.prompt_cache_size, max_kv_size=settings.max_kv_size,
    )  # fmt: skip
    if not engine.drafts and settings.mtp:
        log.warning("%s has no MTP head: decoding without drafting", settings.model)
    if settings.chat_template:
        engine.m.tokenizer.chat_template = settings.chat_template
    return engine


def load_other(settings: ServeSettings, path: str) -> Engine:
    """Another model a request names by path (--allow-model-paths): its own head if it has
    one, plain decoding otherwise."""
    return Engine.load(
        path, mtp="auto", prompt_cache_size=settings.prompt_cache_size,
        max_kv_size=settings.max_kv_size,
    )  # fmt: skip


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a taken port is one `Error:` line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise MtpkitError(
            f"cannot listen on {host}:{port} ({e.strerror}): pick another --port"
        ) from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(settings: ServeSettings) -> None:
    """Serve `settings.model` over the OpenAI API until SIGTERM or Ctrl-C."""
    from mtpkit.serve.app import create_app

    logging.basicConfig(level=settings.log_level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("mtpkit.serve").setLevel(settings.log_level)
    sock = bind(settings.host, settings.port)
    try:
        engine = load_engine(settings)
        load = (lambda path: load_other(settings, path)) if settings.allow_model_paths else None
        worker = Worker(
            engine, capacity=settings.queue_size, load=load,
            concurrency=settings.decode_concurrency, adaptive=settings.adaptive,
        )  # fmt: skip
        if worker.alone_because is not None:
            log.warning("--decode-concurrency %d: %s", settings.decode_concurrency,
                        worker.alone_because)  # fmt: skip
        config = uvicorn.Config(
            create_app(settings, worker), log_level=settings.log_level.lower(), lifespan="off",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN,
        )  # fmt: skip
        server = _Server(config, worker)
        host, port = sock.getsockname()[:2]
        log.info(
            "serving %s on http://%s:%d (drafter: %s, decode concurrency: %d)", settings.model,
            host, port, engine.drafter_name, settings.decode_concurrency if worker.batch else 1,
        )  # fmt: skip
        worker.start()
        try:
            with _signals_end_serving():
                server.run(sockets=[sock])
        finally:
            worker.stop()
    finally:
        sock.close()
    log.info("stopped")


class _Server(uvicorn.Server):
    """uvicorn's server; a stop signal also cancels the decode in flight at once."""

    def __init__(self, config: uvicorn.Config, worker: Worker) -> None:
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.worker.begin_shutdown()
        super().handle_exit(sig, frame)


@contextlib.contextmanager
def _signals_end_serving() -> Iterator[None]:
    """While uvicorn serves, its handlers take SIGINT/SIGTERM; it raises the signal again
    once it stopped, which these no-op handlers absorb: the stop was asked for and done,
    so serving ends with status 0 rather than as an interruption."""
    previous = {sig: signal.signal(sig, _absorb) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _absorb(signum: int, frame: FrameType | None) -> None:
    log.info("stopping on %s", signal.Signals(signum).name)
