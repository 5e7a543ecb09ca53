"""`mtpkit generate`: lossless speculative decoding with the model's own MTP head."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer
from typer.core import TyperCommand

from mtpkit.cli.options import (
    DEFAULT_PROMPT,
    REMOTE_CODE_NOTE,
    AdapterPathOpt,
    AdaptiveOpt,
    ChatTemplateConfigOpt,
    ChatTemplateOpt,
    DepthOpt,
    DrafterModelOpt,
    ExtraEosTokenOpt,
    GenerateHiddenOpt,
    GenerateModelOpt,
    Hidden,
    IgnoreChatTemplateOpt,
    JsonOpt,
    KvBitsOpt,
    KvGroupSizeOpt,
    MaxKvSizeOpt,
    MaxTokensOpt,
    MinPOpt,
    MinTokensToKeepOpt,
    MtpOpt,
    PipelineOpt,
    PrefillResponseOpt,
    PrefillStepSizeOpt,
    PromptCacheFileOpt,
    PromptLookupMaxOpt,
    PromptLookupMinOpt,
    PromptLookupOpt,
    PromptOpt,
    QuantizedKvStartOpt,
    SampleSeedOpt,
    SystemPromptOpt,
    TempOpt,
    TimeoutOpt,
    TopKOpt,
    TopPOpt,
    TrustRemoteCodeOpt,
    UseDefaultChatTemplateOpt,
    VerboseOpt,
    XtcProbabilityOpt,
    XtcThresholdOpt,
    friendly_errors,
    read_stdin_prompt,
    value,
)
from mtpkit.cli.ranks import (
    DEFAULT_TIMEOUT,
    command_facts,
    on_ranks,
    rank_number,
    refuse_on_ranks,
)

if TYPE_CHECKING:
    from mtpkit.speculative.proposers.choose import DrafterChoice

# `--mtp auto` reaches the command as the --mtp flag and one extra word (generate takes no
# arguments otherwise, so the usage line shows none).
CONTEXT = {"allow_extra_args": True}
EXTRA_EOS = "--extra-eos-token"


class GenerateCommand(TyperCommand):
    """generate's command line, which also takes mlx_lm.generate's `--extra-eos-token A B`
    (argparse's nargs="+"), read as the option given once per token."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, spread_extra_eos(args))


def spread_extra_eos(args: list[str]) -> list[str]:
    """`--extra-eos-token A B --temp 0` as `--extra-eos-token A --extra-eos-token B --temp 0`:
    the words after the option's value, up to the next option, are more tokens (generate
    takes no arguments of its own)."""
    out, state = [], "normal"
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        if state == "value":
            out.append(arg)
            state = "more"
        elif state == "more" and not arg.startswith("-"):
            out += [EXTRA_EOS, arg]
        else:
            out.append(arg)
            state = "value" if arg == EXTRA_EOS else "normal"
            if arg.startswith(EXTRA_EOS + "="):
                state = "more"
    return out


@friendly_errors
def generate_command(
    ctx: typer.Context,
    model: GenerateModelOpt,
    prompt: PromptOpt = None,
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
    draft_model: DrafterModelOpt = None,
    prompt_lookup: PromptLookupOpt = False,
    prompt_lookup_min: PromptLookupMinOpt = 2,
    prompt_lookup_max: PromptLookupMaxOpt = 4,
    adapter_path: AdapterPathOpt = None,
    prefill_step_size: PrefillStepSizeOpt = 2048,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupSizeOpt = 64,
    quantized_kv_start: QuantizedKvStartOpt = 5000,
    prompt_cache_file: PromptCacheFileOpt = None,
    use_default_chat_template: UseDefaultChatTemplateOpt = False,
    chat_template_config: ChatTemplateConfigOpt = None,
    min_tokens_to_keep: MinTokensToKeepOpt = 1,
    xtc_probability: XtcProbabilityOpt = 0.0,
    xtc_threshold: XtcThresholdOpt = 0.0,
) -> None:
    """Generate text, drafting tokens with the model's MTP head (or --draft-model, --prompt-lookup) and verifying them losslessly.

    Greedy output is token for token the model's own (as stock mlx-lm's); at --temp > 0 exact rejection sampling keeps the model's distribution. The head drafts by default; --draft-model DIR drafts with a separate model of the same tokenizer (checked before decoding) or, for a Gemma 4 target, its MTP assistant (reading the target's KV cache; checked to pair), --prompt-lookup with n-grams of the prompt and output. As mlx_lm.generate prints it: the text between ========== lines, then Prompt:, Generation: and Peak memory: lines, and mtpkit's MTP: line (--verbose False: the text only).
    """
    import sys

    mode = _mtp_mode(ctx, mtp, depth, hidden)
    drafter = _drafter(ctx, mode, draft_model, prompt_lookup, prompt_lookup_min, prompt_lookup_max)
    template_args = _template_args(ctx, chat_template_config)
    from mtpkit.speculative.generate import MlxLmOptions

    options = MlxLmOptions(
        prefill_step_size, kv_bits, kv_group_size, quantized_kv_start, prompt_cache_file,
        xtc_probability, xtc_threshold,
    )  # fmt: skip
    if trust_remote_code:
        typer.echo(REMOTE_CODE_NOTE, err=True)
    # \\n and \\t as mlx_lm.generate reads them
    texts = [p.replace("\\n", "\n").replace("\\t", "\t") for p in prompt or [DEFAULT_PROMPT]]
    if len(texts) > 1:
        _generate_several(ctx, texts, mode, template_args, drafter)
        return
    text = texts[0]
    if text == "-" and rank_number() is not None:
        refuse_on_ranks(
            "--prompt - reads standard input, which mlx.launch hands every rank without ever "
            'closing it: pass the prompt as text (-p "$(cat FILE)")'
        )
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

    # Under mlx.launch: rank 0 prints, the others are silent; all must run the same command.
    facts = command_facts(ctx, per_rank=("model", "json_output", "verbose", "timeout"))
    with on_ranks(timeout, facts, model=model) as ranks:
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
            drafter=drafter,
            options=options,
            adapter_path=adapter_path,
            chat_template_args=template_args,
            min_tokens_to_keep=min_tokens_to_keep,
            default_chat_template=use_default_chat_template,
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


def _generate_several(
    ctx: typer.Context, prompts: list[str], mode: bool | str, template_args: dict | None,
    drafter: DrafterChoice,
) -> None:  # fmt: skip
    """Several --prompt: one batch (`generate_batch.py`), after refusing what only one
    stream does."""
    from mtpkit.cli.commands.generate_batch import generate_several, refuse_one_stream_options
    from mtpkit.core.console import warn

    refuse_one_stream_options(ctx)
    if prompts.count("-") > 1:
        ctx.fail("--prompt - reads standard input once: pass the other prompts as text")
    texts = [read_stdin_prompt() if t == "-" else t for t in prompts]
    p = ctx.params
    generate_several(
        p["model"], texts, json_output=p["json_output"],
        verbose=p["verbose"] == "True" and not p["json_output"], warn=warn,
        max_tokens=p["max_tokens"], mtp=mode, depth=p["depth"], temp=p["temp"],
        top_p=p["top_p"], top_k=p["top_k"], min_p=p["min_p"],
        min_tokens_to_keep=p["min_tokens_to_keep"], seed=p["seed"], hidden=value(p["hidden"]),
        adaptive=p["adaptive"], extra_eos_tokens=p["extra_eos_token"] or (),
        adapter_path=p["adapter_path"], drafter=drafter,
        chat_template=p["chat_template"] and not p["ignore_chat_template"],
        system_prompt=p["system_prompt"], prefill_response=p["prefill_response"],
        template_args=template_args, default_template=p["use_default_chat_template"],
    )  # fmt: skip


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


def _drafter(
    ctx: typer.Context,
    mode: bool | str,
    draft_model: str | None,
    prompt_lookup: bool,
    lookup_min: int,
    lookup_max: int,
) -> DrafterChoice:
    """What drafts, from --draft-model / --prompt-lookup (the head without either)."""
    from mtpkit.speculative.proposers.choose import DrafterChoice

    if draft_model is not None and prompt_lookup:
        ctx.fail("--draft-model and --prompt-lookup are two drafters: pass one")
    if (draft_model is not None or prompt_lookup) and mode is False:
        ctx.fail("--no-mtp decodes plainly: it contradicts --draft-model and --prompt-lookup")
    if lookup_min > lookup_max:
        ctx.fail(f"--prompt-lookup-min {lookup_min} is above --prompt-lookup-max {lookup_max}")
    return DrafterChoice(draft_model, prompt_lookup, lookup_min, lookup_max)


def _template_args(ctx: typer.Context, text: str | None) -> dict | None:
    """--chat-template-config: a JSON object of arguments for the chat template."""
    import json

    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        ctx.fail(
            f"--chat-template-config is not JSON ({e.msg}): pass an object such as '{{\"enable_thinking\": false}}'"
        )
    if not isinstance(value, dict):
        ctx.fail("--chat-template-config must be a JSON object (name: value)")
    return value
