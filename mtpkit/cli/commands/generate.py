"""`mtpkit generate`: lossless speculative decoding with the model's own MTP head."""

from __future__ import annotations

import typer

from mtpkit.cli.options import (
    DEFAULT_PROMPT,
    REMOTE_CODE_NOTE,
    AdaptiveOpt,
    ChatTemplateOpt,
    DepthOpt,
    ExtraEosTokenOpt,
    GenerateHiddenOpt,
    GenerateModelOpt,
    Hidden,
    IgnoreChatTemplateOpt,
    JsonOpt,
    MaxKvSizeOpt,
    MaxTokensOpt,
    MinPOpt,
    MtpOpt,
    PipelineOpt,
    PrefillResponseOpt,
    PromptOpt,
    SampleSeedOpt,
    SystemPromptOpt,
    TempOpt,
    TimeoutOpt,
    TopKOpt,
    TopPOpt,
    TrustRemoteCodeOpt,
    VerboseOpt,
    friendly_errors,
    read_stdin_prompt,
    value,
)
from mtpkit.cli.ranks import DEFAULT_TIMEOUT, on_ranks

# `--mtp auto` reaches the command as the --mtp flag and one extra word (generate takes no
# arguments otherwise, so the usage line shows none).
CONTEXT = {"allow_extra_args": True}


@friendly_errors
def generate_command(
    ctx: typer.Context,
    model: GenerateModelOpt,
    prompt: PromptOpt = DEFAULT_PROMPT,
    max_tokens: MaxTokensOpt = 256,
    mtp: MtpOpt = None,
    depth: DepthOpt = None,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    min_p: MinPOpt = 0.0,
    top_k: TopKOpt = 0,
    seed: SampleSeedOpt = None,
    hidden: GenerateHiddenOpt = None,
    adaptive: AdaptiveOpt = True,
    chat_template: ChatTemplateOpt = True,
    ignore_chat_template: IgnoreChatTemplateOpt = False,
    system_prompt: SystemPromptOpt = None,
    prefill_response: PrefillResponseOpt = None,
    max_kv_size: MaxKvSizeOpt = None,
    extra_eos_token: ExtraEosTokenOpt = None,
    verbose: VerboseOpt = "True",
    trust_remote_code: TrustRemoteCodeOpt = False,
    json_output: JsonOpt = False,
    pipeline: PipelineOpt = False,
    timeout: TimeoutOpt = DEFAULT_TIMEOUT,
) -> None:
    """Generate text, drafting tokens with the model's MTP head and verifying them losslessly.

    Greedy output is token for token the model's own (as stock mlx-lm's); at --temp > 0 exact rejection sampling keeps the model's distribution. As mlx_lm.generate prints it: the text between ========== lines, then Prompt:, Generation: and Peak memory: lines, and mtpkit's MTP: line (--verbose False: the text only).
    """
    import sys

    mode = _mtp_mode(ctx, mtp, depth, hidden)
    if trust_remote_code:
        typer.echo(REMOTE_CODE_NOTE, err=True)
    text = prompt.replace("\\n", "\n").replace("\\t", "\t")  # as mlx_lm.generate reads it
    text = read_stdin_prompt() if text == "-" else text
    verbose_output = verbose == "True" and not json_output

    from mtpkit.cli.output import FRAME, print_generate, print_json
    from mtpkit.core.console import warn
    from mtpkit.speculative.generate import generate

    framed = []  # mlx-lm's opening frame, printed with the first text (not before an error)

    def stream(segment: str) -> None:
        if verbose_output and not framed:
            print(FRAME)
            framed.append(True)
        sys.stdout.write(segment)
        sys.stdout.flush()

    with on_ranks(timeout) as ranks:  # under mlx.launch: rank 0 prints, the others are silent
        result = generate(
            model,
            text,
            max_tokens=max_tokens,
            mtp=mode,
            depth=depth,
            temp=temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            hidden=value(hidden),
            adaptive=adaptive,
            chat_template=chat_template and not ignore_chat_template,
            system_prompt=system_prompt,
            prefill_response=prefill_response,
            max_kv_size=max_kv_size,
            extra_eos_tokens=extra_eos_token or (),
            on_token=None if json_output or not ranks.is_root else stream,
            warn=warn if ranks.is_root else lambda message: None,
            pipeline=pipeline,
        )
    if not ranks.is_root:
        return
    if json_output:
        print_json(result.to_json())
    elif verbose_output:
        if not framed:
            print(FRAME)
        print_generate(result)
    else:
        sys.stdout.write("\n")


def _mtp_mode(
    ctx: typer.Context, mtp: bool | None, depth: int | None, hidden: Hidden | None
) -> bool | str:
    """True, False or "auto" from --mtp/--no-mtp and the one word `--mtp auto` may add;
    anything else on the line is a usage error, as is a draft depth for plain decoding."""
    extra = list(ctx.args)
    if extra == ["auto"] and mtp is True:
        return "auto"
    if extra:
        hint = " (only `--mtp auto` takes a word)" if "auto" in extra else ""
        ctx.fail(f"Got unexpected extra argument ({' '.join(extra)}){hint}")
    if mtp is False and depth is not None:
        ctx.fail("--depth drafts with the head: it contradicts --no-mtp")
    if mtp is False and hidden is not None:
        ctx.fail("--hidden feeds the head: it contradicts --no-mtp")
    return "auto" if mtp is None else mtp
