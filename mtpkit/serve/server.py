"""`serve`: load the model once, start the decoding thread, run uvicorn until SIGTERM or
Ctrl-C, then stop cleanly (the decode in flight is cancelled, waiting requests get a 503,
the process ends with status 0)."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import uvicorn

from mtpkit.core.console import printable
from mtpkit.core.errors import MtpkitError
from mtpkit.serve.guard import checked_api_key
from mtpkit.serve.oracle import OracleAnswers
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
        adapter_path=settings.adapter_path,
    )  # fmt: skip
    engine.prefill_step_size = settings.prefill_step_size
    if not engine.drafts and settings.mtp:
        log.warning("%s has no MTP head: decoding without drafting", settings.model)
    tokenizer = engine.m.tokenizer
    if settings.chat_template:
        tokenizer.chat_template = settings.chat_template
    else:
        if settings.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = getattr(tokenizer, "default_chat_template", None)
        from mtpkit.core.templates import ChatTemplateError, check_template

        own = getattr(tokenizer, "chat_template", None)
        try:  # rendered bounded per request; a syntax error shows now, once
            check_template(own, "the model's chat template") if own is not None else None
        except ChatTemplateError as e:
            log.warning("%s: chat completions will be refused", e)
    return engine


def _check_at_start(settings: ServeSettings) -> None:
    """What the operator passed, checked before the model loads: a key that can
    authenticate, a template that parses, template arguments that are variables."""
    from mtpkit.core.templates import check_template, template_variables

    checked_api_key(settings.api_key)
    if settings.chat_template:
        check_template(settings.chat_template, "--chat-template")
    template_variables(settings.chat_template_args)
    root = settings.allow_model_paths
    if root is not None and not Path(root).expanduser().is_dir():
        raise MtpkitError(f"--allow-model-paths {root}: no such directory (name the root of "
                          "the model directories requests may load)")  # fmt: skip


def oracle_answers(settings: ServeSettings, engine: Engine) -> OracleAnswers | None:
    """--oracle-acceptance's kept answers (SYNTHETIC), where the engine drafts with the head."""
    if settings.oracle_acceptance is None:
        return None
    if engine.drafter_name != "mtp":
        raise MtpkitError(
            f"--oracle-acceptance replaces the MTP head's drafts, and {settings.model} "
            "decodes without one: serve a model with an MTP head (or --random's)"
        )
    log.warning(
        "SYNTHETIC: oracle drafts at acceptance %g for every greedy prompt answered before "
        "(for benchmarks only)", settings.oracle_acceptance,
    )  # fmt: skip
    eos = set(getattr(engine.m.tokenizer, "eos_token_ids", None) or [])
    return OracleAnswers(settings.oracle_acceptance, eos)


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

    _check_at_start(settings)
    _log_printably(settings.log_level)
    if settings.api_key is None and not _loopback(settings.host):
        log.warning(
            "serving on %s without --api-key: anyone who reaches this host can use the model",
            settings.host,
        )  # fmt: skip
    sock = bind(settings.host, settings.port)
    try:
        engine = load_engine(settings)
        load = (lambda path: load_other(settings, path)) if settings.allow_model_paths else None
        worker = Worker(
            engine, capacity=settings.queue_size, load=load,
            concurrency=settings.decode_concurrency, adaptive=settings.adaptive,
            oracle=oracle_answers(settings, engine),
        )  # fmt: skip
        if worker.alone_because is not None:
            log.warning("--decode-concurrency %d: %s", settings.decode_concurrency,
                        worker.alone_because)  # fmt: skip
        config = uvicorn.Config(
            create_app(settings, worker), log_level=settings.log_level.lower(), lifespan="off",
            log_config=None,  # uvicorn's records reach the root's printable handler
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


class PrintableFormatter(logging.Formatter):
    """Every log line as text, whatever a client sent: terminal controls escaped (a model
    name or path echoed in a message or a traceback cannot retitle or clear the operator's
    terminal), lone surrogates written as escapes (the line always encodes)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return printable(text.encode("utf-8", "backslashreplace").decode("utf-8"))


def _log_printably(level: str) -> None:
    """The root logger's one handler, on stderr, with `PrintableFormatter`; mtpkit's and
    uvicorn's loggers at `level`."""
    handler = logging.StreamHandler()
    handler.setFormatter(PrintableFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for name in ("mtpkit.serve", "uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(level)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


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
