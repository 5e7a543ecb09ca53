"""`mtpkit chat`: mlx_lm.chat's interactive loop, drafting with the MTP head."""

from __future__ import annotations

import typer

from mtpkit.cli.options import (
    REMOTE_CODE_NOTE,
    AdapterPathOpt,
    DepthOpt,
    DrafterModelOpt,
    GenerateModelOpt,
    MaxKvSizeOpt,
    MaxTokensOpt,
    MinPOpt,
    MinTokensToKeepOpt,
    MtpOpt,
    PipelineOpt,
    PrefillStepSizeOpt,
    PromptLookupOpt,
    SampleSeedOpt,
    SystemPromptOpt,
    TempOpt,
    TopKOpt,
    TopPOpt,
    TrustRemoteCodeOpt,
    XtcProbabilityOpt,
    XtcThresholdOpt,
    friendly_errors,
)

HELP = "The command list:\n- 'q' to exit\n- 'r' to reset the chat\n- 'h' to display these commands"


@friendly_errors
def chat_command(
    ctx: typer.Context,
    model: GenerateModelOpt,
    max_tokens: MaxTokensOpt = 256,
    mtp: MtpOpt = None,
    depth: DepthOpt = None,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    min_p: MinPOpt = 0.0,
    top_k: TopKOpt = 0,
    min_tokens_to_keep: MinTokensToKeepOpt = 1,
    seed: SampleSeedOpt = None,
    system_prompt: SystemPromptOpt = None,
    max_kv_size: MaxKvSizeOpt = None,
    draft_model: DrafterModelOpt = None,
    prompt_lookup: PromptLookupOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
    adapter_path: AdapterPathOpt = None,
    prefill_step_size: PrefillStepSizeOpt = 2048,
    xtc_probability: XtcProbabilityOpt = 0.0,
    xtc_threshold: XtcThresholdOpt = 0.1,
    pipeline: PipelineOpt = False,
) -> None:
    """Chat with a model in the terminal (as mlx_lm.chat), drafting with its MTP head.

    Reads a message per line from standard input ('q' exits, 'r' resets the conversation, 'h' lists the commands), streams each answer (Ctrl-C stops the answer, not the chat), then one line: what drafted, its acceptance, and how many prompt tokens came from the cache (each turn prefills only what it adds, as mlx_lm.chat keeps its cache). --draft-model and --prompt-lookup draft instead of the head; --no-mtp decodes plainly. mlx_lm.chat's flags mean what they mean there.
    """
    import sys

    from mtpkit.core.errors import MtpkitError
    from mtpkit.speculative.accept import SamplingSettings
    from mtpkit.speculative.chat import Conversation, interrupt_ends_answer, turn_summary
    from mtpkit.speculative.session import load

    if draft_model is not None and prompt_lookup:
        ctx.fail("--draft-model and --prompt-lookup are two drafters: pass one")
    if pipeline:
        ctx.fail("--pipeline splits a model across mlx.launch ranks; chat runs on one machine")
    if xtc_probability > 0:
        raise MtpkitError(
            "--xtc-probability: XTC's random cut cannot judge a draft, and chat decodes on "
            "mtpkit's loop: use mlx_lm.chat for XTC sampling"
        )
    if trust_remote_code:
        typer.echo(REMOTE_CODE_NOTE, err=True)
    engine = load(
        model, draft_model=draft_model, prompt_lookup=prompt_lookup,
        mtp="auto" if mtp is None else mtp, max_kv_size=max_kv_size, adapter_path=adapter_path,
    )  # fmt: skip
    sampling = SamplingSettings.checked(
        temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep,
        vocab_size=engine.m.vocab_size,
    )
    conversation = Conversation(
        engine, system_prompt, max_tokens, sampling, seed, depth, prefill_step_size
    )
    print(f"[INFO] Starting chat session with {model}.\n{HELP}", flush=True)
    while True:
        print(">> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "q":
            break
        text = line.rstrip("\n")
        if text.strip() == "r":
            conversation.reset()
            continue
        if text.strip() == "h":
            print(HELP, flush=True)
            continue
        session = conversation.turn(text)
        with interrupt_ends_answer(session):
            for event in session:
                print(event.text, end="", flush=True)
        print(flush=True)
        conversation.remember(session)
        print(turn_summary(session), flush=True)
