"""`mtpkit train-head`: give a model an MTP head by self-distillation, backbone frozen.

For every batch of token chunks the frozen backbone runs once (no cache, no gradient) and
gives its hidden states h and its next-token distributions p. The head then drafts, teacher
forced, for every position k at once, from (h_k, embedding of t_{k+1}), and its distribution
q_k for the token after next is pulled towards the backbone's own p_{k+1}:

    loss = mean_k KL(p_{k+1} || q_k)

so the head learns exactly what greedy or sampled verification will accept. Hidden states
exist only for the batch at hand. With `depth` > 1 the head also rolls out: step j feeds
step j-1's output back in (as the runtime's drafting does, `mtpkit.speculative.proposers.mtp_head.HeadProposer`)
with the embedding of t_{k+1+j}, against p_{k+1+j}. A rollout step attends over its own
step's outputs, where the runtime attends over step-0 entries: an approximation that only
the rollout steps make.

Every `eval_every` steps held-out depth-1 acceptance is measured: greedy drafting with the
head over held-out prompts, the loop `generate --mtp` runs (`mtpkit.speculative.decode.MtpDecoder`). A checkpoint
(head, optimizer, data position) is written atomically every `checkpoint_every` steps, and
`resume` continues from it with the same batches an uninterrupted run would see.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from mtpkit.core.choices import POST_NORM, require_depth
from mtpkit.core.errors import MtpkitError
from mtpkit.core.prompts import BUILTIN_PROMPTS
from mtpkit.families import family_for
from mtpkit.families.head import MtpHead
from mtpkit.runtime.model import MtpModel, load_model
from mtpkit.speculative.decode import MtpDecoder, SamplingSettings
from mtpkit.train.checkpoint import finite, load_checkpoint, remove_checkpoint, save_checkpoint
from mtpkit.train.data import ChunkStream, DataSpec, end_token, generate_pool, greedy_sequences
from mtpkit.train.init_head import initial_head
from mtpkit.train.output import head_dtype


class TrainError(MtpkitError):
    """Bad train-head settings or a checkpoint that does not match them."""


@dataclass(frozen=True)
class TrainSettings:
    """Everything a run depends on; a checkpoint records it and `resume` must match it."""

    # The defaults reach the shipped head's acceptance on the bundled example, stripped and
    # retrained (`bench/train_defaults.py`); 400 steps of 128 tokens at 2e-3 fell short
    # and took longer.
    steps: int = 500
    lr: float = 3e-3
    batch_size: int = 8
    seq_len: int = 64
    seed: int = 0
    depth: int = 1
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_every: int = 50
    checkpoint_every: int = 100
    heldout_prompts: tuple[str, ...] = BUILTIN_PROMPTS[:8]
    heldout_tokens: int = 48
    data: DataSpec = field(default_factory=DataSpec)

    def check(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 2 + self.depth:
            raise TrainError("--steps and --batch-size must be >= 1, --seq-len >= depth + 2")
        require_depth(self.depth)
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise TrainError(f"--lr must be a positive finite number, not {self.lr}")
        numbers = (self.weight_decay, self.grad_clip)
        if not all(math.isfinite(x) and x >= 0 for x in numbers):
            raise TrainError("--weight-decay and --grad-clip must be finite numbers >= 0")

    def record(self) -> dict[str, Any]:
        out = asdict(self)
        out["data"] = self.data.describe()
        out["heldout_prompts"] = len(self.heldout_prompts)
        return out


@dataclass
class TrainResult:
    """What a run did (`to_json`: the stable keys of `train-head --json`)."""

    model: str
    family: str
    steps: int
    resumed_from: int
    seconds: float
    cpu_seconds: float
    tokens: int
    loss_first: float | None
    loss_last: float | None
    heldout_start: float | None
    heldout_final: float | None
    history: list[dict[str, Any]]
    peak_rss_bytes: int
    peak_mlx_bytes: int
    settings: dict[str, Any]
    init: dict[str, Any]
    dtype: str = "bfloat16"
    hidden: str = POST_NORM
    head: MtpHead | None = None

    @property
    def steps_per_s(self) -> float:
        trained = self.steps - self.resumed_from
        return trained / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "output": None,
            "family": self.family,
            "steps": self.steps,
            "resumed_from": self.resumed_from,
            "seconds": round(self.seconds, 3),
            "cpu_seconds": round(self.cpu_seconds, 3),
            "steps_per_s": round(self.steps_per_s, 4),
            "tokens": self.tokens,
            "loss_first": self.loss_first,
            "loss_last": self.loss_last,
            "heldout_acceptance_start": self.heldout_start,
            "heldout_acceptance": self.heldout_final,
            "history": self.history,
            "peak_rss_bytes": self.peak_rss_bytes,
            "peak_mlx_bytes": self.peak_mlx_bytes,
            "settings": self.settings,
            "init": self.init,
        }


# --------------------------------------------------------------------------- the maths


def backbone_pass(m: MtpModel, tokens: mx.array) -> tuple[mx.array, mx.array]:
    """The frozen backbone over `tokens` [B, T]: its log-probabilities [B, T, V] (float32)
    and the hidden state [B, T, H] the head drafts from."""
    logits = m.model(tokens)
    hidden = m.hidden_state()
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    return mx.stop_gradient(logprobs), mx.stop_gradient(hidden.astype(mx.float32))


def head_steps(
    head: MtpHead, m: MtpModel, hidden: mx.array, embedded: mx.array, depth: int
) -> list[mx.array]:
    """Head logits for steps 0..depth-1: step j's row k drafts t_{k+2+j} (teacher forced).

    `hidden` [B, T, H] (float32) and `embedded` [B, T, H] come from `backbone_pass` and the
    embedding; step j's logits are [B, T - 1 - j, V] (float32)."""
    out = []
    prev = hidden[:, :-1]
    for j in range(depth):
        x = head(prev, embedded[:, 1 + j :], None, step=j)
        normed = head.final_norm(head.layer_for_step(j))(x)
        out.append(m.lm_head(normed).astype(mx.float32))
        prev = (normed if m.hidden == POST_NORM else x)[:, :-1]
    return out


def distillation_loss(
    head: MtpHead,
    m: MtpModel,
    hidden: mx.array,
    embedded: mx.array,
    teacher: mx.array,
    depth: int,
) -> mx.array:
    """Mean over rollout steps and positions of KL(backbone || head); `teacher` [B, T, V] is
    the backbone's log-probabilities (`backbone_pass`)."""
    total = mx.array(0.0)
    for j, logits in enumerate(head_steps(head, m, hidden, embedded, depth)):
        logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        p_log = teacher[:, 1 + j :]
        total = total + (mx.exp(p_log) * (p_log - logq)).sum(axis=-1).mean()
    return total / depth


def heldout_acceptance(
    head: MtpHead, m: MtpModel, sequences: list[tuple[list[int], int]]
) -> float | None:
    """Greedy depth-1 acceptance of drafting with `head` over the held-out prompts: the
    drafting loop `generate --mtp` runs (`mtpkit.speculative.decode.MtpDecoder`), for as many tokens as the
    backbone's greedy continuation of each prompt holds."""
    drafting = replace(m, head=head)
    drafted = accepted = 0
    for tokens, prompt_len in sequences:
        decoder = MtpDecoder(
            drafting, tokens[:prompt_len], depth=1, sampling=SamplingSettings(), adaptive=False
        )
        for _ in decoder.tokens(len(tokens) - prompt_len):
            pass
        drafted += decoder.stats.drafted
        accepted += decoder.stats.accepted
    return accepted / drafted if drafted else None


# --------------------------------------------------------------------------- the run


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def make_optimizer(settings: TrainSettings) -> optim.Optimizer:
    warmup = min(settings.warmup, settings.steps - 1)
    decay = optim.cosine_decay(settings.lr, max(settings.steps - warmup, 1), settings.lr * 0.05)
    schedule = (
        optim.join_schedules([optim.linear_schedule(0.0, settings.lr, warmup), decay], [warmup])
        if warmup > 0
        else decay
    )
    return optim.AdamW(learning_rate=schedule, weight_decay=settings.weight_decay)


@dataclass
class Run:
    """The moving parts of one training run."""

    m: MtpModel
    head: MtpHead
    opt: optim.Optimizer
    stream: ChunkStream
    heldout: list[tuple[list[int], int]]
    settings: TrainSettings
    history: list[dict[str, Any]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def step_fn(self) -> Callable[[mx.array], mx.array]:
        m, head, opt, depth = self.m, self.head, self.opt, self.settings.depth
        clip = self.settings.grad_clip

        def loss_fn(hidden: mx.array, embedded: mx.array, teacher: mx.array) -> mx.array:
            return distillation_loss(head, m, hidden, embedded, teacher, depth)

        value_and_grad = nn.value_and_grad(head, loss_fn)

        def step(tokens: mx.array) -> mx.array:
            teacher, hidden = backbone_pass(m, tokens)
            embedded = mx.stop_gradient(m.embed(tokens).astype(mx.float32))
            loss, grads = value_and_grad(hidden, embedded, teacher)
            if clip > 0:
                grads, _ = optim.clip_grad_norm(grads, clip)
            opt.update(head, grads)
            mx.eval(loss, head.parameters(), opt.state)
            return loss

        return step

    def record(self, step: int, model: str) -> dict[str, Any]:
        """What a checkpoint keeps beside the weights: enough to resume exactly."""
        return {
            "step": step,
            "chunks": self.stream.consumed,
            "model": model,
            "settings": self.settings.record(),
            "history": self.history,
            "losses": self.losses,
        }

    def evaluate(self, step: int, loss: float | None) -> float | None:
        acc = heldout_acceptance(self.head, self.m, self.heldout)
        self.history.append({"step": step, "loss": loss, "heldout_acceptance": acc})
        return acc


def prepare_data(
    m: MtpModel,
    settings: TrainSettings,
    log: Callable[[str], None],
    on_data: Callable[[int, int], None] | None = None,
) -> tuple[ChunkStream, list[tuple[list[int], int]], list[list[int]] | None]:
    """The chunk stream and the held-out sequences (the pool when self-generated);
    `on_data(done, total)` follows the generation of the pool."""
    spec = settings.data
    pool = None
    if not spec.files:
        chunks = settings.steps * settings.batch_size
        log("generating text to train on")
        pool = generate_pool(
            m.model,
            m.tokenizer,
            spec,
            length=settings.seq_len,
            seed=settings.seed,
            chunks=chunks,
            progress=on_data,
        )
    stream = ChunkStream(
        length=settings.seq_len,
        seed=settings.seed,
        end=end_token(m.tokenizer),
        pool=pool,
        tokenizer=m.tokenizer,
        files=spec.files,
    )
    heldout = greedy_sequences(
        m.model,
        m.tokenizer,
        settings.heldout_prompts,
        max_tokens=settings.heldout_tokens,
        chat_template=spec.chat_template,
    )
    return stream, heldout, pool


def train_head(
    model: str | Path,
    *,
    settings: TrainSettings = TrainSettings(),
    checkpoint_dir: Path | None = None,
    resume: bool = False,
    log: Callable[[str], None] = lambda s: None,
    on_step: Callable[[int, float | None, float | None], None] | None = None,
    on_data: Callable[[int, int], None] | None = None,
) -> TrainResult:
    """Train an MTP head for the model directory `model`; the head is in the result (write
    it with `mtpkit.train.output`). `on_step(step, loss, heldout)` follows the run (step 0:
    loss None, the held-out acceptance before training); `on_data(done, total)` the
    generation of its text, before the first step."""
    settings.check()
    cpu_started = time.process_time()
    m = load_model(model, with_head=False)
    family = family_for(m.config)
    head, init = initial_head(family, m.model, m.parts, 1)
    opt = make_optimizer(settings)
    opt.init(head.trainable_parameters())
    first_step = 0
    if resume:
        if checkpoint_dir is None:
            raise TrainError("--resume needs the checkpoint directory of the earlier run")
        state = load_checkpoint(checkpoint_dir, head, opt, settings.record(), str(model))
        first_step = int(state["step"])
        log(f"resuming from step {first_step}")
    mx.random.seed(settings.seed)
    stream, heldout, _ = prepare_data(m, settings, log, on_data)
    run = Run(m, head, opt, stream, heldout, settings)
    if resume:
        stream.skip(int(state["chunks"]))
        run.history = list(state.get("history", []))
        run.losses = list(state.get("losses", []))
    else:
        start_acc = run.evaluate(0, None)
        if on_step is not None:
            on_step(0, None, start_acc)
    step_fn = run.step_fn()
    train_started = time.perf_counter()
    for step in range(first_step + 1, settings.steps + 1):
        loss = step_fn(stream.next_batch(settings.batch_size)).item()
        saving = checkpoint_dir is not None and (
            step % settings.checkpoint_every == 0 or step == settings.steps
        )
        if not math.isfinite(loss) or ((saving or step == settings.steps) and not _finite(head)):
            raise diverged(step, loss, settings.lr)
        run.losses.append(loss)
        acc = None
        if step % settings.eval_every == 0 or step == settings.steps:
            acc = run.evaluate(step, loss)
        if saving:
            assert checkpoint_dir is not None
            save_checkpoint(checkpoint_dir, head, opt, run.record(step, str(model)))
        if on_step is not None:
            on_step(step, loss, acc)
    seconds = time.perf_counter() - train_started
    accs = [h["heldout_acceptance"] for h in run.history]
    return TrainResult(
        model=str(model),
        family=family.name,
        steps=settings.steps,
        resumed_from=first_step,
        seconds=seconds,
        cpu_seconds=time.process_time() - cpu_started,
        tokens=(settings.steps - first_step) * settings.batch_size * settings.seq_len,
        loss_first=run.losses[0] if run.losses else None,
        loss_last=run.losses[-1] if run.losses else None,
        heldout_start=accs[0] if accs else None,
        heldout_final=accs[-1] if accs else None,
        history=run.history,
        peak_rss_bytes=peak_rss_bytes(),
        peak_mlx_bytes=int(mx.get_peak_memory()),
        settings=settings.record(),
        init=init,
        dtype=head_dtype(m.embedding),
        hidden=m.hidden,
        head=head,
    )


def _finite(head: MtpHead) -> bool:
    return all(finite(v) for _, v in tree_flatten(head.parameters()))


def diverged(step: int, loss: float, lr: float) -> TrainError:
    """The run stops at the first step whose loss or head is not finite: such a head never
    drafts right, and is never written or checkpointed."""
    what = f"the loss is {loss}" if not math.isfinite(loss) else "the head holds NaN or Inf"
    return TrainError(
        f"training diverged at step {step} ({what}); nothing was written: train again with a "
        f"lower --lr (this run: {lr:g})"
    )


def default_checkpoint_dir(output: Path | None, into: Path | None) -> Path:
    """OUT.train-state beside OUT, or DIR/.mtp-train-state inside DIR."""
    if into is not None:
        return into / ".mtp-train-state"
    assert output is not None
    return output.parent / f"{output.name}.train-state"


def train_and_write(
    model: str,
    *,
    settings: TrainSettings = TrainSettings(),
    output: Path | None = None,
    into: Path | None = None,
    force: bool = False,
    checkpoint_dir: Path | None = None,
    resume: bool = False,
    quiet: bool = False,
) -> dict[str, Any]:
    """What `mtpkit train-head` does: train, write the head (`mtpkit.train.output`), drop
    the checkpoints; returns the `--json` summary."""
    from mtpkit.core.console import log
    from mtpkit.train.output import check_destination, require_writable, write_trained_head
    from mtpkit.train.progress import TrainProgress

    check_destination(output, into, force, model)
    settings.check()
    checkpoints = checkpoint_dir or default_checkpoint_dir(output, into)
    created = not (checkpoints.exists() or checkpoints.is_symlink())
    require_writable(checkpoints, f"--checkpoint-dir {checkpoints}")
    progress = TrainProgress(settings.steps, quiet=quiet, log=log)
    try:
        result = train_head(
            model,
            settings=settings,
            checkpoint_dir=checkpoints,
            resume=resume,
            log=(lambda s: None) if quiet else log,
            on_step=progress,
            on_data=progress.data,
        )
    finally:
        progress.close()
    assert result.head is not None
    summary = result.to_json()
    target = write_trained_head(
        Path(result.model),
        result.head,
        output=output,
        into=into,
        force=force,
        dtype=result.dtype,
        hidden=result.hidden,
        training={k: v for k, v in summary.items() if k not in ("history", "output")},
    )
    remove_checkpoint(checkpoints, created=created)
    summary["output"] = str(target)
    return summary
