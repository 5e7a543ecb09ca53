"""mlx_lm.generate's flags beyond sampling (issue 32, item 10): each does what mlx-lm's does,
checked against `python -m mlx_lm generate` run with the same flags in its own process; the
ones only plain decoding honours are one line under MTP."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

PROMPT = "Create a new event loop. You"
BIN = Path(sys.executable).parent


def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if ok:
        assert out.returncode == 0, out.stderr
    return out


def text_of(stdout: str) -> str:
    """The generated text between mlx-lm's `==========` frames."""
    return stdout.split("==========")[1]


def both(model: Path, *flags: str, ours: tuple[str, ...] = ("--no-mtp",)) -> tuple[str, str]:
    common = ["--model", str(model), "--prompt", PROMPT, "--max-tokens", "24", *flags]
    mine = run(str(BIN / "mtpkit"), "generate", *common, *ours).stdout
    theirs = run(sys.executable, "-m", "mlx_lm", "generate", *common).stdout
    return text_of(mine), text_of(theirs)


@pytest.mark.parametrize(
    "flags",
    [
        ("--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "4"),
        ("--temp", "0.9", "--seed", "3", "--xtc-probability", "0.5", "--xtc-threshold", "0.1"),
        ("--temp", "0.9", "--seed", "4", "--min-p", "0.3", "--min-tokens-to-keep", "3"),
        ("--prefill-step-size", "3"),
    ],
    ids=["kv-bits", "xtc", "min-tokens-to-keep", "prefill-step"],
)
def test_plain_decoding_takes_mlx_lms_flags(converted: Path, flags: tuple[str, ...]) -> None:
    mine, theirs = both(converted, *flags)
    assert mine == theirs


def test_prefill_step_and_min_tokens_to_keep_with_mtp(converted: Path) -> None:
    mine, theirs = both(converted, "--prefill-step-size", "3", ours=("--mtp",))
    assert mine == theirs


def test_plain_only_flags_under_mtp_are_one_line(converted: Path) -> None:
    for flags in (["--kv-bits", "4"], ["--xtc-probability", "0.2"], ["--prompt-cache-file", "x"]):
        out = run(str(BIN / "mtpkit"), "generate", "--model", str(converted), "--mtp", *flags,
                  ok=False)  # fmt: skip
        assert out.returncode == 1
        lines = out.stderr.strip().splitlines()
        assert (
            len(lines) == 1
            and "only applies to plain decoding" in lines[0]
            and "--no-mtp" in lines[0]
        )


def test_a_saved_prompt_cache_continues_as_mlx_lm_continues_it(
    converted: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache.safetensors"
    run(sys.executable, "-m", "mlx_lm", "cache_prompt", "--model", str(converted),
        "--prompt", "Create a new event", "--prompt-cache-file", str(cache))  # fmt: skip
    common = ["--model", str(converted), "--prompt", " loop. You", "--max-tokens", "16",
              "--prompt-cache-file", str(cache)]  # fmt: skip
    mine = run(str(BIN / "mtpkit"), "generate", *common, "--no-mtp").stdout
    theirs = run(sys.executable, "-m", "mlx_lm", "generate", *common).stdout
    assert text_of(mine) == text_of(theirs)


def test_lora_adapters_apply_as_in_mlx_lm(converted: Path, tmp_path: Path) -> None:
    """A LoRA adapter with nonzero weights changes the text; mtpkit applies it as mlx-lm does
    (plain and with the head: greedy MTP output is the adapted model's own)."""
    import mlx_lm
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = mlx_lm.load(str(converted))
    config = {"fine_tune_type": "lora", "num_layers": 2,
              "lora_parameters": {"rank": 4, "scale": 20.0, "dropout": 0.0}}  # fmt: skip
    model.freeze()
    linear_to_lora_layers(model, 2, config["lora_parameters"])
    mx.random.seed(0)
    weights = {
        k: mx.random.normal(v.shape) * 0.05 for k, v in tree_flatten(model.trainable_parameters())
    }
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    mx.save_safetensors(str(adapter / "adapters.safetensors"), weights)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    plain_mine, theirs = both(converted, "--adapter-path", str(adapter))
    assert plain_mine == theirs
    assert theirs != both(converted)[1]  # the adapter changed the text
    mtp_mine, _ = both(converted, "--adapter-path", str(adapter), ours=("--mtp",))
    assert mtp_mine == theirs


def test_convert_dequantize_is_one_line(tmp_path: Path) -> None:
    from tests.conftest import EXAMPLE

    out = run(str(BIN / "mtpkit"), "convert", str(EXAMPLE), "-o", str(tmp_path / "o"),
              "--dequantize", ok=False)  # fmt: skip
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1
    assert "--dequantize is not supported" in out.stderr and not (tmp_path / "o").exists()
