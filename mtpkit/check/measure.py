"""Running a checkpoint for `mtpkit check`'s probes: a local copy the runtime can run, and
the head's greedy acceptance per prompt under each variant (the diagnosis is `probes.py`).

On MLX's CPU backend a bf16/fp16 MoE model runs with its experts upcast to float32
(`mtpkit.runtime.upcast`); `model_moe_dtype` loads the model once first, so a model whose float32
experts would not fit is found before any probe (`ExpertsTooLarge`).
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mtpkit.check.probes import Diagnosis, MeasureFn, Measurement, Variant, diagnose
from mtpkit.check.variants import RESPONSE_MARGIN, SIGNIFICANCE_Z
from mtpkit.checkpoint.inspect import Checkpoint
from mtpkit.convert.destination import remove_stale_work_dirs, work_dir_prefix
from mtpkit.core.errors import MtpkitError


def model_moe_dtype(model_dir: Path) -> str | None:
    """Load the model as the probes will (cached) and say which dtype its experts run in."""
    from mtpkit.runtime.model import load_model

    return load_model(model_dir).moe_dtype


# --------------------------------------------------------------------------- measuring


class RuntimeMeasure:
    """Greedy depth-1 acceptance of the head, drafting at every step with the runtime's loop
    (what `generate --mtp` runs), over `prompts`; None when nothing was drafted (the model
    ended the text at once: no evidence about the head either way).

    The probes measure a variant prompt by prompt, so the model under one variant is loaded
    once and kept for the next call (its backbone is cached by the runtime as well).
    """

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._model: Any = None

    def __call__(
        self,
        model_dir: str | Path,
        prompts: Sequence[str],
        *,
        max_tokens: int,
        hidden: str | None = None,
        concat_order: str | None = None,
        norm_shift: float = 0.0,
    ) -> float | None:
        from mtpkit.runtime.model import load_model
        from mtpkit.speculative.generate import head_counts

        key = (str(model_dir), hidden, concat_order, norm_shift)
        if key != self._key:
            self._model = load_model(
                model_dir, hidden=hidden, concat_order=concat_order, norm_shift=norm_shift
            )
            self._key = key
        drafted, accepted = head_counts(self._model, prompts, max_tokens=max_tokens)
        return accepted / drafted if drafted else None


def default_measure() -> MeasureFn:
    """The runtime's acceptance measurement (greedy generation with the head)."""
    try:
        import mtpkit.speculative.decode  # noqa: F401
    except ImportError as e:  # pragma: no cover - the runtime ships with mtpkit
        raise MtpkitError(f"the MTP runtime is not available ({e}); run with --no-probe") from None
    return RuntimeMeasure()


# A variant is measured on at least this many prompts before it may stop early.
EARLY_STOP_PROMPTS = 8


class PromptProbe:
    """Measures the shipped head and its variants prompt by prompt on one set of prompts.

    Two savings, neither of which changes what the rule decides:
    - a prompt the model ends before any draft carries no evidence about the head, and
      greedy verification is lossless, so it ends as early under every variant: it is left
      out when the shipped head (always measured first) finds it, instead of scoring 0% for
      every variant (which diluted the acceptance and every gain);
    - a variant stops after `EARLY_STOP_PROMPTS` prompts once it is both unusable (below
      --min-acceptance) and below the shipped head by `RESPONSE_MARGIN`, each at
      `SIGNIFICANCE_Z` standard errors: no rule fails or warns on such a variant (they need a
      gain, or a usable variant) and it counts as collapsed either way. Healthy heads collapse
      under swapped inputs and norms without their +1, and a collapsed variant drafts (and
      so costs) the most rounds.
    """

    def __init__(
        self,
        measure: MeasureFn,
        model_dir: Path,
        prompts: Sequence[str],
        shipped: Variant,
        *,
        max_tokens: int,
        min_acceptance: float,
        what: str,
        log: Callable[[str], None],
    ) -> None:
        self.measure, self.model_dir, self.prompts = measure, model_dir, list(prompts)
        self.shipped, self.max_tokens, self.min_acceptance = shipped, max_tokens, min_acceptance
        self.what, self.log = what, log
        self.base: list[float] | None = None

    def __call__(self, variant: Variant) -> Measurement:
        self.log(f"probing {variant.describe()} on {len(self.prompts)} {self.what}")
        first = self.base is None and variant == self.shipped
        kept: list[str] = []
        values: list[float] = []
        for prompt in self.prompts:
            value = self._one(prompt, variant)
            if value is None and first:
                continue
            kept.append(prompt)
            values.append(value if value is not None and math.isfinite(value) else 0.0)
            if not first and self._settled(values):
                self.log(f"stopped after {len(values)} {self.what}: unusable and collapsed")
                break
        if first:
            self._keep(kept, values)
        return Measurement(variant, values)

    def _one(self, prompt: str, variant: Variant) -> float | None:
        kwargs: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "norm_shift": float(variant.norm_shift),
        }
        # As shipped, the runtime reads its settings from the checkpoint itself.
        kwargs["hidden"] = variant.hidden if variant.hidden != self.shipped.hidden else None
        kwargs["concat_order"] = (
            variant.concat_order if variant.concat_order != self.shipped.concat_order else None
        )
        value = self.measure(str(self.model_dir), [prompt], **kwargs)
        return None if value is None else float(value)

    def _keep(self, kept: list[str], values: list[float]) -> None:
        dropped = len(self.prompts) - len(kept)
        if not kept:
            raise MtpkitError(
                f"the model ended all {len(self.prompts)} {self.what} before the head drafted "
                "anything: probe with prompts it continues (--prompts FILE)"
            )
        if dropped:
            self.log(f"{dropped} of the {self.what} ended before any draft: left out")
        self.prompts, self.base = kept, values

    def _settled(self, values: list[float]) -> bool:
        """Unusable and collapsed, at SIGNIFICANCE_Z standard errors (see the class)."""
        k = len(values)
        if self.base is None or k < EARLY_STOP_PROMPTS:
            return False
        diffs = [b - a for a, b in zip(self.base, values, strict=False)]
        gain_high = statistics.fmean(diffs) + SIGNIFICANCE_Z * _stderr(diffs)
        acceptance_high = statistics.fmean(values) + SIGNIFICANCE_Z * _stderr(values)
        return gain_high <= -RESPONSE_MARGIN and acceptance_high < self.min_acceptance


def _stderr(values: list[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.inf


def probe_directory(
    model_dir: Path,
    shipped: Variant,
    prompts: Sequence[str],
    *,
    measure: MeasureFn,
    reserve: Sequence[str],
    min_acceptance: float,
    max_tokens: int,
    zero_centred: bool,
    log: Callable[[str], None],
) -> Diagnosis:
    """Measure the head in `model_dir` as shipped and under its variants, and diagnose it."""

    def probe(chosen: Sequence[str], what: str) -> PromptProbe:
        return PromptProbe(
            measure,
            model_dir,
            chosen,
            shipped,
            max_tokens=max_tokens,
            min_acceptance=min_acceptance,
            what=what,
            log=log,
        )

    started = time.monotonic()
    diagnosis = diagnose(
        probe(prompts, "prompts"),
        shipped,
        min_acceptance=min_acceptance,
        zero_centred=zero_centred,
        measure_more=probe(reserve, "more prompts (undecided)") if reserve else None,
    )
    log(f"probes took {time.monotonic() - started:.0f} s")
    return diagnosis


# --------------------------------------------------------------------------- a runnable copy


def cache_root() -> Path:
    """Where converted copies of raw checkpoints are kept (`MTPKIT_CACHE`, else ~/.cache)."""
    root = os.environ.get("MTPKIT_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "mtpkit"


@contextmanager
def runnable_copy(ckpt: Checkpoint, *, log: Callable[[str], None]) -> Iterator[Path]:
    """A local MLX directory the runtime can run: the source itself, or a converted copy.

    An MLX directory (mtpkit's sidecar, the inline layout, vllm-mlx sidecars) is probed as it
    is; on the Hub it is downloaded through `mtpkit.checkpoint.source` into the Hugging Face cache that
    `generate` also reads. A raw checkpoint is converted with `mtpkit convert` first, into a
    temporary directory for a local one, and for a Hub repo into the mtpkit cache, keyed by
    its commit, and reused on the next run.
    """
    source = ckpt.source
    if ckpt.format == "mlx":
        if source.kind != "local":
            log(f"downloading {source.describe()}")
        yield source.snapshot_dir()
        return
    from mtpkit.convert.pipeline import convert

    if source.kind == "local":
        # A raw checkpoint is run the way users run it: through `mtpkit convert`.
        # In the cache root (on the home disk, like the Hub cache), not in a small /tmp.
        cache_root().mkdir(parents=True, exist_ok=True)
        remove_stale_work_dirs(cache_root(), "check", log)
        scratch = work_dir_prefix("check")
        with tempfile.TemporaryDirectory(prefix=scratch, dir=cache_root()) as tmp:
            out = Path(tmp) / "converted"
            log(f"converting {source.describe()} for the probes")
            convert(source.spec, output=out)
            yield out
        return
    key = f"{source.spec.replace('/', '--')}--{source.commit or source.revision or 'main'}"
    out = cache_root() / "check" / key
    if not (out / "config.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        log(f"converting {source.describe()} into {out}")
        convert(source.spec, output=out, revision=source.commit or source.revision, force=True)
    yield out
