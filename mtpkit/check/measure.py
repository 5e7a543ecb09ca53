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
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mtpkit.check.probes import Diagnosis, MeasureFn, Measurement, Variant, diagnose
from mtpkit.checkpoint.inspect import Checkpoint
from mtpkit.convert.destination import remove_stale_work_dirs, work_dir_prefix
from mtpkit.core.errors import MtpkitError


def model_moe_dtype(model_dir: Path) -> str | None:
    """Load the model as the probes will (cached) and say which dtype its experts run in."""
    from mtpkit.runtime.model import load_model

    return load_model(model_dir).moe_dtype


# --------------------------------------------------------------------------- measuring


def default_measure() -> MeasureFn:
    """The runtime's acceptance measurement (greedy generation with the head)."""
    try:
        from mtpkit.speculative.generate import measure_acceptance
    except ImportError as e:  # pragma: no cover - the runtime ships with mtpkit
        raise MtpkitError(f"the MTP runtime is not available ({e}); run with --no-probe") from None
    return measure_acceptance


def measure_per_prompt(
    measure: MeasureFn,
    model_dir: Path,
    prompts: Sequence[str],
    variant: Variant,
    shipped: Variant,
    *,
    max_tokens: int,
) -> Measurement:
    """Acceptance of one variant, prompt by prompt (for the paired comparison)."""
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "norm_shift": float(variant.norm_shift)}
    # As shipped, the runtime reads its settings from the checkpoint itself.
    kwargs["hidden"] = variant.hidden if variant.hidden != shipped.hidden else None
    kwargs["concat_order"] = (
        variant.concat_order if variant.concat_order != shipped.concat_order else None
    )
    values = []
    for prompt in prompts:
        value = float(measure(str(model_dir), [prompt], **kwargs))
        values.append(value if math.isfinite(value) else 0.0)
    return Measurement(variant, values)


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

    def measure_on(chosen: Sequence[str], what: str) -> Callable[[Variant], Measurement]:
        def measure_variant(v: Variant) -> Measurement:
            log(f"probing {v.describe()} on {len(chosen)} {what}")
            return measure_per_prompt(measure, model_dir, chosen, v, shipped, max_tokens=max_tokens)

        return measure_variant

    started = time.monotonic()
    diagnosis = diagnose(
        measure_on(prompts, "prompts"),
        shipped,
        min_acceptance=min_acceptance,
        zero_centred=zero_centred,
        measure_more=measure_on(reserve, "more prompts (undecided)") if reserve else None,
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
