"""Every command over every family's fixture in every precision, and over broken inputs.

For each run: the documented exit code (0 done, 3 a failed requirement, 1 an error, 2 a usage
error), no traceback, `--json` stdout that parses, standard input never read, no source file
changed, and no partial output or temporary sibling left behind. Runs are in-process
(CliRunner) on tiny fixtures with short generations, so the whole file stays fast.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import shutil
import struct
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import typer.testing
from typer.testing import CliRunner

from mtpkit.cli.app import app
from mtpkit.convert.pipeline import convert
from tests.checkpoints import MOE_LAYOUTS, RAW_WITH_MTP

# MLX's CPU backend cannot run MoE layers in bf16/fp16 (GatherMM is float32-only) until they
# are computed in float32; until then those runs are skipped and `check` runs without probes.
HALF_PRECISION_MOE_RUNS = True

PRECISIONS = ("bfloat16", "float16", "float32", "4bit")
COMMANDS = ("inspect", "convert", "graft", "generate", "bench", "check")
NUMERIC = ("generate", "bench")
PROMPT = "Say hi."
TEMP_MARKS = ("mtpkit-tmp", "mtpkit-old")


class StdinRead(AssertionError):
    """Raised by the standard input of every run: nothing may read it."""


class Untouchable(io.RawIOBase):
    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        raise StdinRead("a command read standard input")


@pytest.fixture(autouse=True)
def untouchable_stdin(monkeypatch, tmp_path):
    """Standard input that fails when read; the probe cache kept inside the test's folder."""
    monkeypatch.setattr(typer.testing, "make_input_stream", lambda *_: Untouchable())
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "mtpkit-cache"))


class CurrentStderr:
    """Writes to whatever `sys.stderr` is now (each CliRunner run has its own)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


@pytest.fixture(autouse=True)
def logging_to_current_stderr(monkeypatch):
    """transformers' log handler keeps the stderr of the run that created it, closed once that
    CliRunner run ends; a real process has one stderr, so point the handler at the current one."""
    from transformers.utils import logging as hf_logging

    for handler in hf_logging.get_logger().handlers:
        if type(handler) is logging.StreamHandler:  # not pytest's capturing subclasses
            monkeypatch.setattr(handler, "stream", CurrentStderr())


def tree_hash(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def leftovers(*roots: Path, beside: tuple[Path, ...] = ()) -> list[Path]:
    """Temporary files or directories inside `roots` (at any depth) or directly in the
    directories `beside` (where a temp sibling of an output would be: their other children
    belong to other tests)."""
    found = []
    for root in roots:
        for p in [root, *root.rglob("*")] if root.exists() else []:
            if any(mark in p.name for mark in TEMP_MARKS):
                found.append(p)
    for parent in beside:
        for p in parent.iterdir() if parent.exists() else []:
            if any(mark in p.name for mark in TEMP_MARKS):
                found.append(p)
    return found


def run(
    args: list[str],
    *,
    code: int | tuple[int, ...],
    untouched: tuple[Path, ...] = (),
    watched: tuple[Path, ...] = (),
    absent: tuple[Path, ...] = (),
) -> typer.testing.Result:
    """Invoke the CLI and assert what every run must hold (see the module docstring).

    `untouched`: directories whose files must not change; `watched`: directories (with the
    untouched ones) that must hold no temporary sibling afterwards; `absent`: outputs that
    must not exist afterwards (a failed run writes nothing)."""
    before = {root: tree_hash(root) for root in untouched}
    result = CliRunner().invoke(app, args)
    codes = (code,) if isinstance(code, int) else code
    assert not isinstance(result.exception, StdinRead), args
    assert result.exit_code in codes, (args, result.output)
    assert "Traceback" not in result.output, result.output
    if result.exit_code in (1, 2):
        assert result.stderr.splitlines()[-1].startswith("Error: "), result.stderr
        if result.exit_code == 1:
            assert len(result.stderr.splitlines()) == 1, result.stderr
    if "--json" in args and result.exit_code in (0, 3):
        json.loads(result.stdout)
    for root in untouched:
        assert tree_hash(root) == before[root], f"{root} changed"
    parents = tuple({p.parent for p in (*untouched, *watched, *absent)})
    assert leftovers(*untouched, *watched, beside=parents) == []
    for path in absent:
        assert not path.exists(), path
    return result


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def matrix(checkpoint, tmp_path_factory) -> Callable[[str, str], tuple[Path, Path]]:
    """`matrix(layout, precision)`: the fixture (a raw checkpoint in that dtype; for 4bit the
    float32 one) and its conversion (as stored; 4bit: --bits 4 with float32 scales)."""
    cache: dict[tuple[str, str], tuple[Path, Path]] = {}

    def build(layout: str, precision: str) -> tuple[Path, Path]:
        if (layout, precision) not in cache:
            dtype = "float32" if precision == "4bit" else precision
            source = checkpoint(layout, dtype=dtype)
            out = tmp_path_factory.mktemp("matrix") / f"{layout}-{precision}"
            if precision == "4bit":
                convert(str(source), output=out, bits=4, dtype="float32")
            else:
                convert(str(source), output=out)
            cache[layout, precision] = source, out
        return cache[layout, precision]

    return build


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.json"
    path.write_text(json.dumps([PROMPT]))
    return path


def runs_numerically(layout: str, precision: str) -> bool:
    return HALF_PRECISION_MOE_RUNS or not (
        layout in MOE_LAYOUTS and precision in ("bfloat16", "float16")
    )


# --------------------------------------------------------------------------- the matrix


# bench times what generate decodes, whose numerics the matrix proves in every precision; two
# precisions run bench's own code (its costs, stock's row, the oracle) on every family.
BENCH_PRECISIONS = ("float32", "4bit")
CELLS = [
    (layout, precision, command)
    for layout in RAW_WITH_MTP
    for precision in PRECISIONS
    for command in COMMANDS
    if command != "bench" or precision in BENCH_PRECISIONS
]


@pytest.mark.parametrize(("layout", "precision", "command"), CELLS)
def test_matrix(matrix, prompts_file, tmp_path, layout, precision, command):
    numeric = runs_numerically(layout, precision)
    if command in NUMERIC and not numeric:
        pytest.skip(f"{layout} in {precision}: MoE on MLX's CPU backend needs float32")
    source, model = matrix(layout, precision)
    fixture = model if precision == "4bit" else source
    keep = (source, model)
    if command == "inspect":
        result = run(["inspect", str(fixture), "--json"], code=0, untouched=keep)
        assert json.loads(result.stdout)["mtp"]["present"] is True
    elif command == "convert":
        out = tmp_path / "out"
        bits = ["--bits", "4", "--dtype", "float32"] if precision == "4bit" else []
        result = run(
            ["convert", str(source), "-o", str(out), *bits, "--json"], code=0, untouched=keep
        )
        assert json.loads(result.stdout)["head_tensors"] > 0
        assert (out / "mtp" / "weights.safetensors").is_file()
    elif command == "graft":
        into = Path(shutil.copytree(model, tmp_path / "into"))
        graft = ["convert", str(source), "--mtp-only", "--into", str(into), "--json"]
        run(graft, code=1, untouched=(*keep, into))  # it has a head: refused without --force
        result = run([*graft, "--force"], code=0, untouched=keep, watched=(into,))
        assert json.loads(result.stdout)["head_tensors"] > 0
    elif command == "generate":
        args = ["generate", "--model", str(model), "-p", PROMPT, "--max-tokens", "4", "--mtp"]
        result = run([*args, "--json"], code=0, untouched=keep)
        assert json.loads(result.stdout)["mtp"] is True
    elif command == "bench":
        args = ["bench", "--model", str(model), "--trials", "1", "--max-tokens", "4"]
        result = run([*args, "--depth", "1", "--json"], code=0, untouched=keep)
        assert [r["depth"] for r in json.loads(result.stdout)["runs"]] == [1]
        assert "trial 1/1: MTP depth 1" in result.stderr
    else:
        report = tmp_path / "report.xml"
        probe = ["--prompts", str(prompts_file), "--max-tokens", "4"] if numeric else ["--no-probe"]
        args = ["check", str(fixture), "--junit", str(report), *probe, "--json"]
        result = run(args, code=(0, 3), untouched=keep, watched=(tmp_path / "mtpkit-cache",))
        verdict = json.loads(result.stdout)["verdict"]
        assert result.exit_code == (0 if verdict != "fail" else 3)
        suite = ET.parse(report).getroot()
        assert suite.get("errors") == "0" and int(suite.get("tests")) > 0


# --------------------------------------------------------------------------- broken inputs


def damaged(checkpoint, tmp_path: Path, how: str) -> Path:
    """A copy of the mimo fixture damaged in one way."""
    root = Path(shutil.copytree(checkpoint("mimo", dtype="float32"), tmp_path / f"mimo-{how}"))
    config = json.loads((root / "config.json").read_text())
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    if how == "word_count":
        config["num_nextn_predict_layers"] = "one"
    elif how == "no_model_type":  # and no text_config naming it: the family is unknown
        del config["model_type"]
    elif how == "hostile_header":
        shard = root / sorted(set(index["weight_map"].values()))[-1]
        data = shard.read_bytes()
        shard.write_bytes(struct.pack("<Q", 2**62) + data[8:])
    elif how == "unsafe_path":
        name = next(iter(index["weight_map"]))
        index["weight_map"][name] = "../../outside.safetensors"
    elif how == "duplicate_tensor":  # a tensor of the second shard, changed, also in the first
        first, second = sorted(set(index["weight_map"].values()))
        name = next(n for n, s in index["weight_map"].items() if s == second)
        tensors = mx.load(str(root / first))
        tensors[name] = mx.load(str(root / second))[name] + 1
        mx.save_safetensors(str(root / first), tensors, {"format": "pt"})
    elif how == "metadata_not_string":
        shard = root / sorted(set(index["weight_map"].values()))[0]
        tensors = mx.load(str(shard))
        mx.save_safetensors(str(shard), tensors, {"format": "pt"})
        data = shard.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        header["__metadata__"] = {"format": "pt", "step": 3}
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])
    elif how == "absurd_size":
        config["hidden_size"] = 10**12
    elif how == "eps_word":
        config["rms_norm_eps"] = "tiny"
    (root / "config.json").write_text(json.dumps(config))
    index_path.write_text(json.dumps(index))
    return root


# (how the mimo fixture is damaged, command) -> the documented exit code
BROKEN = {
    # A named problem (invalid_config) since config values are validated in one place.
    ("word_count", "inspect"): 0,
    ("word_count", "convert"): 1,
    ("word_count", "check"): 3,
    ("no_model_type", "inspect"): 1,
    ("no_model_type", "convert"): 1,
    ("no_model_type", "check"): 1,
    ("hostile_header", "inspect"): 0,
    ("hostile_header", "convert"): 1,
    ("hostile_header", "check"): 3,
    ("unsafe_path", "inspect"): 0,
    ("unsafe_path", "convert"): 1,
    ("unsafe_path", "check"): 3,
    # The audit's classes: duplicated tensors, odd header metadata, config types and sizes.
    ("duplicate_tensor", "inspect"): 0,
    ("duplicate_tensor", "convert"): 1,
    ("metadata_not_string", "inspect"): 0,
    ("metadata_not_string", "convert"): 1,
    ("metadata_not_string", "check"): 3,
    ("absurd_size", "convert"): 1,
    ("absurd_size", "check"): 3,
    ("eps_word", "inspect"): 0,
    ("eps_word", "convert"): 1,
}


# The problem code each damage must be reported as, and what convert's line must name.
NAMED_CAUSE = {
    "duplicate_tensor": ("duplicate_tensor", "model-00001-of-00002.safetensors", "the index names"),
    "metadata_not_string": ("corrupt_header", "model-00001-of-00002.safetensors", "'step'"),
    "absurd_size": ("invalid_config", "hidden_size=1000000000000"),
    "eps_word": ("invalid_config", "rms_norm_eps='tiny'"),
}


@pytest.mark.parametrize(("how", "command"), list(BROKEN))
def test_broken_inputs(checkpoint, tmp_path, how, command):
    root = damaged(checkpoint, tmp_path, how)
    out, report = tmp_path / "out", tmp_path / "report.xml"
    args = {
        "inspect": ["inspect", str(root), "--json"],
        "convert": ["convert", str(root), "-o", str(out), "--json"],
        "check": ["check", str(root), "--junit", str(report), "--no-probe", "--json"],
    }[command]
    result = run(args, code=BROKEN[how, command], untouched=(root,), absent=(out,))
    if command == "inspect" and result.exit_code == 0:
        assert json.loads(result.stdout)["problems"]
    if how in NAMED_CAUSE:  # the line names the cause, not a later symptom
        if command == "inspect":
            codes = [p["code"] for p in json.loads(result.stdout)["problems"]]
            assert NAMED_CAUSE[how][0] in codes, codes
        elif command == "convert":
            assert all(part in result.stderr for part in NAMED_CAUSE[how]), result.stderr
    if command == "check":
        suite = ET.parse(report).getroot()
        kind = "error" if result.exit_code == 1 else "failure"
        assert suite.find(f"testsuite/testcase/{kind}") is not None


def test_usage_and_missing_paths(checkpoint, tmp_path):
    model = tmp_path / "model"
    convert(str(checkpoint("mimo", dtype="float32")), output=model)
    m = ["--model", str(model)]
    for args in (
        ["bench", *m, "--trials", "0"],
        ["bench", *m, "--max-tokens", "0"],
        ["generate", *m, "-p", PROMPT, "--temp", "nan"],
        ["generate", *m, "-p", PROMPT, "--temp", "-1"],
        ["generate", *m, "-p", PROMPT, "--max-tokens", "-5"],
        ["generate", *m, "-p", PROMPT, "--top-p", "5"],
        ["check", str(model), "--min-acceptance", "2"],
    ):
        run(args, code=2, untouched=(model,))
    run(["inspect", "models/Qwen3.5-été", "--json"], code=1)
    run(["inspect", str(tmp_path / "nowhere"), "--json"], code=1)
    headless = checkpoint("mlx_plain", dtype="float32")  # a published build without its head
    args = ["generate", "--model", str(headless), "-p", PROMPT, "--max-tokens", "4", "--mtp", "--json"]
    run(args, code=1, untouched=(headless,))


def test_outputs_overlapping_the_source(checkpoint, tmp_path):
    parent = tmp_path / "models"
    source = Path(shutil.copytree(checkpoint("mimo", dtype="float32"), parent / "mimo"))
    (parent / "notes.txt").write_text("a sibling file\n")
    for out in (parent, source, source / "mlx"):
        run(
            ["convert", str(source), "-o", str(out), "--force", "--json"],
            code=1,
            untouched=(parent,),
        )
    graft = ["convert", str(source), "--mtp-only", "--into", str(source), "--force"]
    run(graft, code=1, untouched=(parent,))


# --------------------------------------------------------------------------- the audit's classes
# One case per class and command, families sampled (one dense-with-MTP, one MoE, one MLX
# layout) so the whole section stays a few seconds: the classes, not every example.

SAMPLED = ("mimo", "qwen3_5")


@pytest.mark.parametrize(
    ("variable", "value", "command"),
    [
        ("HF_HUB_ETAG_TIMEOUT", "ten", "inspect"),
        ("HF_HUB_DOWNLOAD_TIMEOUT", "-1", "convert"),
        ("HF_HUB_OFFLINE", "maybe", "check"),
        ("MTPKIT_CACHE", "{file}", "check"),
        ("TMPDIR", "{missing}", "generate"),
        ("MTPKIT_THREADS", "many", "convert"),
    ],
)
def test_bad_environment_variables(checkpoint, tmp_path, monkeypatch, variable, value, command):
    source = checkpoint("mimo", dtype="float32")
    (tmp_path / "a-file").write_text("x")
    value = value.format(file=tmp_path / "a-file", missing=tmp_path / "missing")
    monkeypatch.setenv(variable, value)
    out = tmp_path / "out"
    args = {
        "inspect": ["inspect", str(source)],
        "convert": ["convert", str(source), "-o", str(out)],
        "check": ["check", str(source), "--max-tokens", "2"],
        "generate": ["generate", "--model", str(source), "-p", PROMPT, "--max-tokens", "2"],
    }[command]
    result = run(args, code=1, untouched=(source,), absent=(out,))
    assert result.stderr.startswith(f"Error: {variable}={value}") or result.stderr.startswith(
        f"Error: {variable}={value!r}"
    ), result.stderr


def test_odd_bytes_on_stdin_are_one_line(matrix, monkeypatch):
    import click.testing

    # The one command that reads stdin, when asked to (`-p -`): given bytes that are not text.
    monkeypatch.setattr(typer.testing, "make_input_stream", click.testing.make_input_stream)
    _, model = matrix("mimo", "float32")
    args = ["generate", "--model", str(model), "-p", "-", "--max-tokens", "2"]
    result = CliRunner().invoke(app, args, input=b"Say \xff\xfe hi")
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "Error: --prompt -: standard input is not UTF-8 text (byte 0xff at offset 4): pass "
        "the prompt as UTF-8"
    ]


@pytest.mark.parametrize("layout", SAMPLED)
@pytest.mark.parametrize("command", ["generate", "bench", "check"])
def test_a_model_without_tokenizer_files_says_so(matrix, tmp_path, layout, command):
    _, model = matrix(layout, "float32")
    bare = Path(shutil.copytree(model, tmp_path / "bare"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    args = {
        "generate": ["generate", "--model", str(bare), "-p", PROMPT, "--max-tokens", "2"],
        "bench": ["bench", "--model", str(bare), "--trials", "1", "--max-tokens", "2"],
        "check": ["check", str(bare), "--max-tokens", "2"],
    }[command]
    result = run(args, code=1, untouched=(bare,))
    assert "has no tokenizer files (tokenizer.json" in result.stderr
    assert len(result.stderr.splitlines()) == 1  # no library warnings before the Error line


@pytest.mark.parametrize("command", ["convert", "graft", "train-head"])
def test_paths_and_links_into_another_model(matrix, tmp_path, command):
    """A link inside the output that leads into another model, or an output that is a link
    to the source's data: refused, and nothing outside the output changes."""
    source, model = matrix("mimo", "float32")
    other = Path(shutil.copytree(model, tmp_path / "other"))
    if command == "graft":
        into = Path(shutil.copytree(model, tmp_path / "into", ignore=shutil.ignore_patterns("mtp")))
        (into / "mtp").symlink_to(other / "mtp")
        args = ["convert", str(source), "--mtp-only", "--into", str(into), "--force"]
        watched: tuple[Path, ...] = (into,)
    else:
        link = tmp_path / "link-to-source"
        link.symlink_to(source if command == "convert" else model)
        model_arg = str(source if command == "convert" else model)
        args = [command, model_arg, "-o", str(link / "sub"), "--force"]
        watched = ()
    run(args, code=1, untouched=(source, model, other), watched=watched)


@pytest.mark.parametrize("layout", SAMPLED)
def test_a_full_disk_is_one_line_and_leaves_nothing(checkpoint, tmp_path, layout):
    """`ulimit -f` (64 KiB) makes every write past it fail with EFBIG, as a full disk does."""
    import subprocess

    source = checkpoint(layout, dtype="float32")
    out = tmp_path / "out"
    script = f'ulimit -f 64; exec "{sys.executable}" -m mtpkit convert "{source}" -o "{out}" --quiet'
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["sh", "-c", script], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: writing {out} failed, nothing was ")
    assert "File too large" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_tables_print_whole_when_piped(matrix, monkeypatch):
    """stdout is a pipe (CliRunner's, as `| tee log`): no row is cut to 80 columns."""
    monkeypatch.delenv("COLUMNS", raising=False)
    source, _ = matrix("mimo", "float32")
    result = run(["inspect", str(source)], code=0, untouched=(source,))
    assert "…" not in result.stdout
    assert "model.mtp_layers.0.self_attn.q_proj.weight" in result.stdout
    assert "model-00002-of-00002.safetensors" in result.stdout


@pytest.mark.parametrize(
    ("field", "value", "command"),
    [
        ("quantization", "4bit", "generate"),
        ("rope_scaling", "x", "bench"),
        ("num_hidden_layers", None, "generate"),
        ("eos_token_id", "x", "bench"),
        ("head_dim", -3, "generate"),
    ],
)
def test_config_values_are_checked_before_a_model_is_built(matrix, tmp_path, field, value, command):
    """The runtime checks config.json where inspect and convert check it (`invalid_config`),
    so mlx-lm never builds from a bad value and fails somewhere deep."""
    _, model = matrix("mimo", "float32")
    bad = Path(shutil.copytree(model, tmp_path / "bad"))
    config = json.loads((bad / "config.json").read_text())
    config[field] = value
    (bad / "config.json").write_text(json.dumps(config))
    args = {
        "generate": ["generate", "--model", str(bad), "-p", PROMPT, "--max-tokens", "2"],
        "bench": ["bench", "--model", str(bad), "--trials", "1", "--max-tokens", "2"],
    }[command]
    result = run(args, code=1, untouched=(bad,))
    assert result.stderr.startswith(f"Error: config.json in {bad}: {field}=") or (
        result.stderr.startswith(f"Error: config.json in {bad}: {field} is not")
    ), result.stderr
    assert "(invalid_config)" in result.stderr
