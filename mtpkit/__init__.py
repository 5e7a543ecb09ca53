"""mtpkit: keep, convert, run and check multi-token-prediction heads on MLX.

The Python API, as mlx-lm's: `engine = mtpkit.load(path)` loads a model once (drafting with
its MTP head, a draft model or prompt lookup); `mtpkit.generate(engine, prompt)` returns the
text and `mtpkit.stream_generate(engine, prompt)` yields a `TokenEvent` per token. A text
prompt is the model's input as it stands, as in mlx-lm (`chat_template=True`, or a list of
chat messages, goes through the chat template). `engine.tokenizer` is the model's tokenizer;
`engine.session(mtpkit.Request(prompt=ids))` gives full control (stop strings, seeds, and the
statistics: acceptance, prompt tokens reused from the cache).
"""

from typing import Any

_API = {
    "load": "mtpkit.speculative.session",
    "generate": "mtpkit.speculative.session",
    "stream_generate": "mtpkit.speculative.session",
    "Engine": "mtpkit.speculative.session",
    "Session": "mtpkit.speculative.session",
    "Request": "mtpkit.speculative.session",
    "make_request": "mtpkit.speculative.session",
    "TokenEvent": "mtpkit.speculative.session",
    "SamplingSettings": "mtpkit.speculative.accept",
    "DrafterChoice": "mtpkit.speculative.proposers.choose",
}
__all__ = sorted(_API)


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])


def __getattr__(name: str) -> Any:
    # Read on first use: importing MLX or importlib.metadata takes a tenth of a second, the
    # window in which a Ctrl-C would otherwise end the CLI in a traceback.
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    if name != "__version__":
        raise AttributeError(f"module 'mtpkit' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        # The one version source is pyproject.toml, read from the installed distribution.
        return version("mtpkit")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"
