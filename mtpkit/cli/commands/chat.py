"""`mtpkit chat`: mlx_lm.chat's interactive loop, drafting with the MTP head."""

from __future__ import annotations

import typer

from mtpkit.cli.options import (
    DepthOpt,
    DrafterModelOpt,
    GenerateModelOpt,
    MaxKvSizeOpt,
    MaxTokensOpt,
    MinPOpt,
    MinTokensToKeepOpt,
    MtpOpt,
    PromptLookupOpt,
    SampleSeedOpt,
    SystemPromptOpt,
    TempOpt,
    TopKOpt,
    TopPOpt,
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
) -> None:
    """Chat with a model in the terminal (as mlx_lm.chat), drafting with its MTP head.

    Reads a message per line from standard input ('q' exits, 'r' resets the conversation, 'h' lists the commands), streams each answer, then one line: what drafted, its acceptance, and how many prompt tokens came from the cache (each turn prefills only what it adds). --draft-model and --prompt-lookup draft instead of the head; --no-mtp decodes plainly.
    """
    import sys

    from mtpkit.speculative.accept import SamplingSettings
    from mtpkit.speculative.chat import Conversation, turn_summary
    from mtpkit.speculative.session import load

    if draft_model is not None and prompt_lookup:
        ctx.fail("--draft-model and --prompt-lookup are two drafters: pass one")
    engine = load(
        model, draft_model=draft_model, prompt_lookup=prompt_lookup,
        mtp="auto" if mtp is None else mtp, max_kv_size=max_kv_size,
    )  # fmt: skip
    sampling = SamplingSettings(
        temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, min_tokens_to_keep=min_tokens_to_keep
    )
    conversation = Conversation(engine, system_prompt, max_tokens, sampling, seed, depth)
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
        for event in session:
            print(event.text, end="", flush=True)
        print(flush=True)
        conversation.remember(session.text)
        print(turn_summary(session), flush=True)
