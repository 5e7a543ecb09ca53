"""`mtpkit train-head`: train an MTP head for a model by self-distillation, backbone frozen."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mtpkit.options import JsonOpt, friendly_errors


@friendly_errors
def train_head(
    model: Annotated[str, typer.Argument(help="An MLX model directory (or Hub repo id).")],
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Write a copy of the model with the new head here."),
    ] = None,
    into: Annotated[
        Path | None,
        typer.Option("--into", help="Install the head into this existing conversion instead."),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing OUT, or DIR's existing head.")
    ] = False,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimizer steps.")] = 400,
    lr: Annotated[float, typer.Option("--lr", min=0.0, help="Peak learning rate (AdamW).")] = 2e-3,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Chunks per step.")] = 8,
    seq_len: Annotated[int, typer.Option("--seq-len", min=4, help="Tokens per chunk.")] = 128,
    weight_decay: Annotated[
        float, typer.Option("--weight-decay", min=0.0, help="AdamW weight decay.")
    ] = 0.0,
    grad_clip: Annotated[
        float,
        typer.Option("--grad-clip", min=0.0, help="Clip the gradient's global norm (0: off)."),
    ] = 1.0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the data, sampling and order.")] = 0,
    depth: Annotated[
        int, typer.Option("--depth", min=1, max=4, help="Rollout steps trained (1: NextN only).")
    ] = 1,
    data: Annotated[
        list[Path] | None,
        typer.Option(
            "--data",
            help="Train on these .txt (blank-line separated) or .jsonl (text, messages or "
            "prompt+completion) files instead of text the model generates itself.",
        ),
    ] = None,
    prompts: Annotated[
        Path | None,
        typer.Option(
            "--prompts", help="Prompts to self-generate from (blank-line separated, or .json)."
        ),
    ] = None,
    samples: Annotated[
        int | None,
        typer.Option(
            "--samples-per-prompt",
            min=1,
            help="Generated samples per prompt, or unconditioned samples for a base model"
            " (default: enough that no chunk repeats).",
        ),
    ] = None,
    temperature: Annotated[
        float,
        typer.Option(
            "--temperature",
            min=0.0,
            help="Sampling temperature of generation (half the samples continue greedily).",
        ),
    ] = 0.7,
    chat_template: Annotated[
        bool,
        typer.Option(
            "--chat-template/--no-chat-template",
            help="Wrap prompts in the tokenizer's chat template, where it has one.",
        ),
    ] = True,
    eval_every: Annotated[
        int, typer.Option("--eval-every", min=1, help="Steps between held-out acceptance measurements.")
    ] = 50,
    checkpoint_every: Annotated[
        int, typer.Option("--checkpoint-every", min=1, help="Steps between checkpoints.")
    ] = 100,
    checkpoint_dir: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint-dir",
            help="Where checkpoints go (default: OUT.train-state, or DIR/.mtp-train-state).",
        ),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the checkpoint of an earlier run.")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    json_output: JsonOpt = False,
) -> None:
    """Train an MTP head for MODEL by self-distillation and write it in mtpkit's sidecar format.

    The head (the family's own, or for dense decoders such as Llama, Mistral, Qwen2 and Qwen3
    the DeepSeek/Qwen-Next form) starts from the backbone's last layer and learns the
    backbone's own distribution for the token after next; the backbone stays frozen. By default
    it trains on text the model generates from a built-in prompt set (offline). Progress (loss,
    held-out drafting acceptance) goes to stderr; checkpoints allow --resume. The result is
    used unchanged by generate, bench and check.
    """
    from mtpkit.train_output import check_destination

    check_destination(output, into, force)
    from mtpkit.train_data import check_files

    check_files([str(p) for p in data or []])

    from mtpkit.train import train_and_write

    result = train_and_write(
        model,
        output=output,
        into=into,
        force=force,
        steps=steps,
        lr=lr,
        batch_size=batch_size,
        seq_len=seq_len,
        weight_decay=weight_decay,
        grad_clip=grad_clip,
        seed=seed,
        depth=depth,
        data=[str(p) for p in data or []],
        prompts=str(prompts) if prompts else None,
        samples_per_prompt=samples,
        temperature=temperature,
        chat_template=chat_template,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
        checkpoint_dir=checkpoint_dir,
        resume=resume,
        quiet=quiet or json_output,
    )
    from mtpkit.output import print_json, print_train

    if json_output:
        print_json(result)
    else:
        print_train(result)
