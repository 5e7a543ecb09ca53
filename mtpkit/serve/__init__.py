"""`mtpkit serve`: an OpenAI-compatible server over the library's decoding session
(`mtpkit.speculative.session`), as `mlx_lm.server` is over `stream_generate`.

`schemas.py` the API's bodies, `prompts.py` a body to a decoding request, `worker.py` the one
decoding thread and its bounded queue, `app.py` the FastAPI routes, `server.py` loading and
running (uvicorn) until a stop signal.
"""

from mtpkit.serve.settings import ServeSettings

__all__ = ["ServeSettings", "serve"]


def serve(settings: ServeSettings) -> None:
    """Serve `settings.model` until SIGTERM or Ctrl-C (imports the HTTP stack when called)."""
    from mtpkit.serve.server import serve as run

    run(settings)
