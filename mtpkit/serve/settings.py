"""What `mtpkit serve` was started with: mlx_lm.server's options (same names, same defaults)
and mtpkit's own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mtpkit.speculative.prompt_cache import DEFAULT_SIZE

DEFAULT_MAX_TOKENS = 512  # mlx_lm.server's --max-tokens default
DEFAULT_QUEUE_SIZE = 64
# The largest request body read (bytes); a prompt of a model's whole context is far smaller.
DEFAULT_MAX_BODY = 8 * 1024 * 1024


@dataclass(frozen=True)
class ServeSettings:
    model: str
    host: str = "127.0.0.1"
    port: int = 8080
    # Drafting: the head by default; a draft model or prompt lookup instead; `mtp` True needs a
    # head, "auto" decodes plainly without one, False never drafts.
    draft_model: str | None = None
    prompt_lookup: bool = False
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    mtp: bool | str = "auto"
    depth: int | None = None  # None: adaptive drafting chooses each round's
    adaptive: bool = True
    # Defaults a request's own fields override.
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = DEFAULT_MAX_TOKENS
    chat_template: str = ""  # replaces the tokenizer's own
    chat_template_args: dict[str, Any] = field(default_factory=dict)
    prompt_cache_size: int = DEFAULT_SIZE
    max_kv_size: int | None = None
    log_level: str = "INFO"
    served_model_name: str | None = None  # the id /v1/models lists (default: --model)
    prefill_step_size: int = 2048  # mlx_lm.server's --prefill-step-size
    adapter_path: str | None = None  # LoRA adapters on the backbone (mlx_lm.server's)
    use_default_chat_template: bool = False  # the tokenizer's default where it has none
    # Serving.
    api_key: str | None = None  # checked at start-up (`guard.checked_api_key`)
    max_body: int = DEFAULT_MAX_BODY  # bytes of a request body read at most
    # The directory under which a request's `model` may name another model (None: never).
    allow_model_paths: str | None = None
    queue_size: int = DEFAULT_QUEUE_SIZE
    # Requests decoded together (mlx_lm.server's --decode-concurrency); 1: one stream at a
    # time (the prompt cache serves both).
    decode_concurrency: int = 1
    allowed_origins: tuple[str, ...] = ("*",)
    # SYNTHETIC, for benchmarks: oracle drafts right at this share (`serve/oracle.py`).
    oracle_acceptance: float | None = None
