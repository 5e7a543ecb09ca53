"""`mtpkit serve`: an OpenAI-compatible server that decodes with the model's MTP head."""

from __future__ import annotations

import json
import os
from enum import Enum
from typing import Annotated, Any

import typer

from mtpkit.cli.options import (
    REMOTE_CODE_NOTE,
    AdapterPathOpt,
    AdaptiveOpt,
    DepthOpt,
    DrafterModelOpt,
    GenerateModelOpt,
    MaxKvSizeOpt,
    MinPOpt,
    PrefillStepSizeOpt,
    PromptLookupMaxOpt,
    PromptLookupMinOpt,
    PromptLookupOpt,
    TempOpt,
    TopKOpt,
    TopPOpt,
    TrustRemoteCodeOpt,
    friendly_errors,
)
from mtpkit.cli.values import ranged


class LogLevel(str, Enum):
    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"
    CRITICAL = "CRITICAL"


# mlx_lm.server's flags that mtpkit serve cannot honour, and why (a usage error naming it).
UNSERVED = {
    "--prompt-concurrency": "mtpkit prefills one prompt at a time (a request joins the batch "
    "between rounds): leave it out",
    "--prompt-cache-bytes": "mtpkit's prompt cache is bounded by entries (--prompt-cache-size), "
    "not bytes",
    "--kv-bits": "a quantized KV cache cannot be rolled back after a rejected draft: mtpkit "
    "serve keeps the KV cache in full precision",
    "--kv-group-size": "it sizes --kv-bits' groups, and a quantized KV cache cannot be rolled "
    "back after a rejected draft",
    "--quantized-kv-start": "it starts --kv-bits' quantization, and a quantized KV cache cannot "
    "be rolled back after a rejected draft",
    "--pipeline": "mtpkit serve runs on one machine: pipeline parallelism is not served",
}
Unserved = Annotated[
    str | None, typer.Option(metavar="VALUE", help="mlx_lm.server's; refused here (says why).")
]
UnservedFlag = Annotated[
    bool, typer.Option("--pipeline", help="mlx_lm.server's; refused here (says why).")
]


OracleAcceptanceOpt = Annotated[
    float | None,
    typer.Option(
        "--oracle-acceptance",
        **ranged(float, min=0.0, max=1.0),
        metavar="A",
        help="SYNTHETIC, for benchmarks (`mtpkit bench --serve --acceptance A`): a greedy "
        "request whose prompt the server has answered before decodes with oracle drafts "
        "over that answer: the head runs, its draft at each depth is the answer's token with "
        "probability A (seeded), else a wrong one, and each verdict is held to that plan. "
        "Texts stay greedy only where the verify pass and plain steps agree (CPU float32); "
        "on a GPU in bf16 they may differ. Sampled requests and logits processors are "
        "refused (400).",
    ),
]


def _refuse_unserved(given: dict[str, object]) -> None:
    for flag, value in given.items():
        if value not in (None, False):
            raise typer.BadParameter(f"{flag} is mlx_lm.server's and not served: {UNSERVED[flag]}")


def _json_object(text: str) -> dict[str, Any]:
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"not JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise typer.BadParameter("must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return parsed


@friendly_errors
def serve_command(
    model: GenerateModelOpt,
    host: Annotated[str, typer.Option(help="Host to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")] = 8080,
    draft_model: DrafterModelOpt = None,
    depth: DepthOpt = None,
    mtp: Annotated[
        bool | None,
        typer.Option(
            "--mtp/--no-mtp",
            help="--mtp: draft with the MTP head (an error without one); neither: draft when "
            "the model has a head; --no-mtp: plain decoding.",
        ),
    ] = None,
    prompt_lookup: PromptLookupOpt = False,
    prompt_lookup_min: PromptLookupMinOpt = 2,
    prompt_lookup_max: PromptLookupMaxOpt = 4,
    adaptive: AdaptiveOpt = True,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    max_tokens: Annotated[
        int, typer.Option(min=1, metavar="N", help="Default tokens per request.")
    ] = 512,
    chat_template: Annotated[
        str,
        typer.Option(metavar="TEMPLATE", help="A Jinja chat template replacing the tokenizer's."),
    ] = "",
    chat_template_args: Annotated[
        str,
        typer.Option(
            metavar="JSON",
            help="Arguments for the chat template, e.g. '{\"enable_thinking\": false}'.",
        ),
    ] = "{}",
    prompt_cache_size: Annotated[
        int, typer.Option(min=0, metavar="N", help="Prompt caches kept for later turns (0: none).")
    ] = 10,
    max_kv_size: MaxKvSizeOpt = None,
    log_level: Annotated[LogLevel, typer.Option(help="Logging level.")] = LogLevel.INFO,
    trust_remote_code: TrustRemoteCodeOpt = False,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="MTPKIT_API_KEY", help="Require `Authorization: Bearer KEY` on /v1 routes."
        ),
    ] = None,
    allow_model_paths: Annotated[
        str | None,
        typer.Option(
            metavar="ROOT",
            help="Let a request's `model` name another model directory under ROOT to load.",
        ),
    ] = None,
    queue_size: Annotated[
        int,
        typer.Option(min=1, metavar="N", help="Requests that may wait; more get 503 Retry-After."),
    ] = 64,
    decode_concurrency: Annotated[
        int,
        typer.Option(
            min=1,
            metavar="N",
            help="Requests decoded together in one batch, each row drafting with the "
            "drafter (the head, prompt lookup, a draft model) or none (mlx_lm.server's "
            "flag; its default 32 applies only where it does not speculate). 1: one at a "
            "time. The prompt cache serves both.",
        ),
    ] = 1,
    allowed_origins: Annotated[
        str, typer.Option(metavar="ORIGINS", help="CORS origins, comma-separated.")
    ] = "*",
    served_model_name: Annotated[
        str | None,
        typer.Option(metavar="NAME", help="The model id /v1/models lists (default: --model)."),
    ] = None,
    adapter_path: AdapterPathOpt = None,
    prefill_step_size: PrefillStepSizeOpt = 2048,
    use_default_chat_template: Annotated[
        bool,
        typer.Option(
            "--use-default-chat-template",
            help="Where the tokenizer has no chat template, its default one (mlx_lm.server's); "
            "without either, messages get mlx_lm.server's plain role prefixes.",
        ),
    ] = False,
    prompt_concurrency: Unserved = None,
    prompt_cache_bytes: Unserved = None,
    kv_bits: Unserved = None,
    kv_group_size: Unserved = None,
    quantized_kv_start: Unserved = None,
    pipeline: UnservedFlag = False,
    oracle_acceptance: OracleAcceptanceOpt = None,
) -> None:
    """Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health; also without /v1), drafting with its MTP head.

    mlx_lm.server's options mean what they mean there; every answer is the model's own (greedy: token for token stock mlx-lm's) and carries an `mtp` object (drafter, depth, drafted, accepted, acceptance). One thread decodes (up to --decode-concurrency requests together); requests wait in a queue of --queue-size. Stops cleanly on SIGTERM or Ctrl-C.
    """
    from mtpkit.serve import ServeSettings, serve

    if trust_remote_code:
        typer.echo(REMOTE_CODE_NOTE, err=True)
    if api_key is None and "MTPKIT_API_KEY" in os.environ:  # Click takes "" as unset
        api_key = os.environ["MTPKIT_API_KEY"]  # refused at start-up, never auth turned off
    if draft_model is not None and prompt_lookup:
        raise typer.BadParameter("--draft-model and --prompt-lookup are two drafters: pass one")
    if mtp is False and (draft_model is not None or prompt_lookup or depth is not None):
        raise typer.BadParameter("--no-mtp decodes plainly: it contradicts drafting options")
    if oracle_acceptance is not None:
        _check_oracle_options(mtp, draft_model, prompt_lookup, temp, allow_model_paths)
    _refuse_unserved({
        "--prompt-concurrency": prompt_concurrency, "--prompt-cache-bytes": prompt_cache_bytes,
        "--kv-bits": kv_bits, "--kv-group-size": kv_group_size,
        "--quantized-kv-start": quantized_kv_start, "--pipeline": pipeline,
    })  # fmt: skip
    serve(
        ServeSettings(
            model=model, host=host, port=port, draft_model=draft_model,
            prompt_lookup=prompt_lookup, prompt_lookup_min=prompt_lookup_min,
            prompt_lookup_max=prompt_lookup_max, mtp="auto" if mtp is None else mtp,
            depth=depth, adaptive=adaptive, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p,
            max_tokens=max_tokens, chat_template=chat_template,
            chat_template_args=_json_object(chat_template_args),
            prompt_cache_size=prompt_cache_size, max_kv_size=max_kv_size,
            log_level=log_level.value, api_key=api_key, allow_model_paths=allow_model_paths,
            queue_size=queue_size, decode_concurrency=decode_concurrency,
            served_model_name=served_model_name, adapter_path=adapter_path,
            prefill_step_size=prefill_step_size,
            use_default_chat_template=use_default_chat_template,
            allowed_origins=tuple(o.strip() for o in allowed_origins.split(",") if o.strip()),
            oracle_acceptance=oracle_acceptance,
        )
    )  # fmt: skip
    _exit_now_in_a_console()


def _check_oracle_options(
    mtp: bool | None, draft_model: str | None, prompt_lookup: bool, temp: float,
    allow_model_paths: str | None,
) -> None:  # fmt: skip
    """--oracle-acceptance replaces the head's drafts of the served model's greedy answers."""
    if mtp is False or draft_model is not None or prompt_lookup:
        raise typer.BadParameter(
            "--oracle-acceptance replaces the MTP head's drafts: it takes no --no-mtp, "
            "--draft-model or --prompt-lookup"
        )
    if temp > 0:
        raise typer.BadParameter("--oracle-acceptance follows greedy answers: --temp must be 0")
    if allow_model_paths is not None:
        raise typer.BadParameter(
            "--oracle-acceptance keeps the served model's answers: drop --allow-model-paths"
        )


def _exit_now_in_a_console() -> None:
    """The server has stopped and answered everything: a console process ends here, without
    the interpreter's finalization. Under load, MLX's native threads torn down at that point
    sometimes aborted the process ("terminate called without an active exception", exit
    -6) after a clean stop. Not under a test runner calling the command in-process."""
    import os
    import sys
    from pathlib import Path

    if Path(sys.argv[0]).name not in ("mtpkit", "__main__.py"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
