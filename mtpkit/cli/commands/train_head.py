"""`mtpkit train-head`: train an MTP head for a model by self-distillation, backbone frozen."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mtpkit.cli.options import SEED_MAX, JsonOpt, QuietOpt, friendly_errors, one_source
from mtpkit.cli.values import ranged
from mtpkit.core.choices import MAX_DEPTH, MIN_DEPTH

# The options, named here to keep the command's signature short.
ModelOpt = Annotated[
    str | None,
    typer.Option("--model", metavar="MODEL", help="The same as MODEL (mlx-lm's spelling)."),
]
OutputOpt = Annotated[
    Path | None,
    typer.Option(
        "--output", "-o", metavar="DIR", help="Write a copy of the model with the new head here."
    ),
]
IntoOpt = Annotated[
    Path | None,
    typer.Option(
        "--into", metavar="DIR", help="Install the head into this existing conversion instead."
    ),
]
ForceOpt = Annotated[
    bool, typer.Option("--force", help="Replace an existing OUT, or DIR's existing head.")
]
StepsOpt = Annotated[
    int, typer.Option("--steps", metavar="N", **ranged(int, min=1), help="Optimizer steps.")
]
LrOpt = Annotated[
    float,
    typer.Option("--lr", metavar="X", **ranged(float, min=0.0), help="Peak learning rate (AdamW)."),
]
BatchSizeOpt = Annotated[
    int, typer.Option("--batch-size", metavar="N", **ranged(int, min=1), help="Chunks per step.")
]
SeqLenOpt = Annotated[
    int, typer.Option("--seq-len", metavar="N", **ranged(int, min=4), help="Tokens per chunk.")
]
WeightDecayOpt = Annotated[
    float,
    typer.Option(
        "--weight-decay", metavar="X", **ranged(float, min=0.0), help="AdamW weight decay."
    ),
]
GradClipOpt = Annotated[
    float,
    typer.Option(
        "--grad-clip",
        metavar="X",
        **ranged(float, min=0.0),
        help="Clip the gradient's global norm (0: off).",
    ),
]
SeedOpt = Annotated[
    int,
    typer.Option(
        "--seed",
        **ranged(int, min=0, max=SEED_MAX),
        metavar="N",
        help="Seed of the data, sampling and order.",
    ),
]
DepthOpt = Annotated[
    int,
    typer.Option(
        "--depth",
        metavar="K",
        **ranged(int, min=MIN_DEPTH, max=MAX_DEPTH),
        help="Rollout steps trained (1: NextN only).",
    ),
]
DataOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--data",
        metavar="FILE",
        help="Train on these .txt (blank-line separated) or .jsonl (text, messages or "
        "prompt+completion) files instead of text the model generates itself.",
    ),
]
PromptsOpt = Annotated[
    Path | None,
    typer.Option(
        "--prompts",
        metavar="FILE",
        help="Prompts to self-generate from (blank-line separated, or .json).",
    ),
]
SamplesOpt = Annotated[
    int | None,
    typer.Option(
        "--samples-per-prompt",
        **ranged(int, min=1),
        metavar="N",
        help="Generated samples per prompt, or unconditioned samples for a base model"
        " (default: enough that no chunk repeats).",
    ),
]
TemperatureOpt = Annotated[
    float,
    typer.Option(
        "--temperature",
        **ranged(float, min=0.0),
        metavar="T",
        help="Sampling temperature of generation (half the samples continue greedily).",
    ),
]
ChatTemplateOpt = Annotated[
    bool,
    typer.Option(
        "--chat-template/--no-chat-template",
        help="Wrap prompts in the tokenizer's chat template, where it has one.",
    ),
]
EvalEveryOpt = Annotated[
    int,
    typer.Option(
        "--eval-every",
        metavar="N",
        **ranged(int, min=1),
        help="Steps between held-out acceptance measurements.",
    ),
]
CheckpointEveryOpt = Annotated[
    int,
    typer.Option(
        "--checkpoint-every", metavar="N", **ranged(int, min=1), help="Steps between checkpoints."
    ),
]
CheckpointDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--checkpoint-dir",
        metavar="DIR",
        help="Where checkpoints go (default: OUT.train-state, or DIR/.mtp-train-state).",
    ),
]
ResumeOpt = Annotated[
    bool, typer.Option("--resume", help="Continue from the checkpoint of an earlier run.")
]


@friendly_errors
def train_head_command(
    ctx: typer.Context,
    model: Annotated[
        str | None,
        typer.Argument(
            metavar="MODEL",
            help="An MLX model directory (or Hub repo id; or --model).",
            show_default=False,
        ),
    ] = None,
    model_option: ModelOpt = None,
    output: OutputOpt = None,
    into: IntoOpt = None,
    force: ForceOpt = False,
    # TrainSettings's defaults (written out: the CLI imports no MLX before it runs).
    steps: StepsOpt = 500,
    lr: LrOpt = 3e-3,
    batch_size: BatchSizeOpt = 8,
    seq_len: SeqLenOpt = 64,
    weight_decay: WeightDecayOpt = 0.0,
    grad_clip: GradClipOpt = 1.0,
    seed: SeedOpt = 0,
    depth: DepthOpt = 1,
    data: DataOpt = None,
    prompts: PromptsOpt = None,
    samples: SamplesOpt = None,
    temperature: TemperatureOpt = 0.7,
    chat_template: ChatTemplateOpt = True,
    eval_every: EvalEveryOpt = 50,
    checkpoint_every: CheckpointEveryOpt = 100,
    checkpoint_dir: CheckpointDirOpt = None,
    resume: ResumeOpt = False,
    quiet: QuietOpt = False,
    json_output: JsonOpt = False,
) -> None:
    """Train an MTP head for MODEL by self-distillation and write it in mtpkit's sidecar format.

    The head (the family's own, or for dense decoders such as Llama, Mistral, Qwen2 and Qwen3
    the DeepSeek/Qwen-Next form) starts from the backbone's last layer and learns the
    backbone's own distribution for the token after next; the backbone stays frozen. By default
    it trains on text the model generates itself (offline): continuations of a built-in prompt
    set, or unconditioned text for a base model without a chat template. Progress (loss,
    held-out drafting acceptance) goes to stderr; checkpoints allow --resume. The result is
    used unchanged by generate, bench and check.
    """
    model = _model_and_destination(ctx, model, model_option, output, into)
    from mtpkit.core.corpus import check_files
    from mtpkit.core.prompts import read_prompts
    from mtpkit.train.data import DataSpec
    from mtpkit.train.output import check_destination

    check_destination(output, into, force, model)
    files = tuple(str(p) for p in data or [])
    check_files(files)
    from mtpkit.train.loop import TrainSettings, train_and_write

    spec = DataSpec(
        files=files,
        prompts=tuple(read_prompts(prompts)) if prompts else None,
        samples_per_prompt=samples,
        temperature=temperature,
        chat_template=chat_template,
    )
    settings = TrainSettings(
        steps=steps,
        lr=lr,
        batch_size=batch_size,
        seq_len=seq_len,
        weight_decay=weight_decay,
        grad_clip=grad_clip,
        seed=seed,
        depth=depth,
        eval_every=eval_every,
        checkpoint_every=checkpoint_every,
        data=spec,
    )
    result = train_and_write(
        model,
        settings=settings,
        output=output,
        into=into,
        force=force,
        checkpoint_dir=checkpoint_dir,
        resume=resume,
        quiet=quiet,  # --json keeps progress: it goes to stderr, the JSON to stdout
    )
    from mtpkit.cli.output import print_json, print_train

    if json_output:
        print_json(result)
    else:
        print_train(result)


def _model_and_destination(
    ctx: typer.Context,
    model: str | None,
    model_option: str | None,
    output: Path | None,
    into: Path | None,
) -> str:
    """The model (as MODEL or --model) and exactly one destination, or a usage error."""
    if (output is None) == (into is None):
        ctx.fail(
            "pass -o DIR (a copy with the new head) or --into DIR (install it there), one of them"
        )
    return one_source(ctx, model, model_option, name="MODEL")
