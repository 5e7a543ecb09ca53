"""MTP decoding across ranks: `mlx.launch` with the ring backend over loopback, on the CPU.

The reference is independent of the code under test: stock mlx-lm's `stream_generate` in this
single process. Pipeline parallelism is tested on the DeepSeek/GLM NextN layout (2 and 3
ranks), tensor parallelism on the Qwen3.5 gated-delta-net hybrid (2 ranks; its fixture's 4
attention heads do not split 3 ways). Float32 fixtures: tensor parallelism sums partial
products in another order, which in bfloat16 can flip a greedy near-tie against one process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

from mtpkit.convert.pipeline import convert
from tests import hub_server
from tests.checkpoints import build_checkpoint
from tests.hub_server import HubStandIn

hub = hub_server.hub  # the fixture

ROOT = Path(__file__).resolve().parents[1]
RANK_SCRIPT = ROOT / "tests" / "distributed_rank.py"
PROMPT_TEXT = "Write a story about a cat"
N_TOKENS = 12
LAUNCH_LIMIT = 600  # seconds: far above a run's few seconds (bench's warm-ups on a busy machine took
# over 240), so a hang fails instead of waiting forever


def free_port_base(count: int) -> int:
    """A base port with `count` consecutive free ports after it (mlx.launch's ring uses one
    per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65535:
            continue
        try:
            for p in range(base, base + count):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError("no free ports")


def rank_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("MLX_RANK", None)
    env.pop("MLX_HOSTFILE", None)
    return env


def launch(n: int, *command: str) -> subprocess.CompletedProcess[str]:
    """`mlx.launch -n N --backend ring` of a Python script on this machine."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    args = [str(launcher), "-n", str(n), "--backend", "ring", "--python", sys.executable]
    args += ["--starting-port", str(free_port_base(n)), "--", *command]
    return subprocess.run(
        args, capture_output=True, text=True, timeout=LAUNCH_LIMIT, env=rank_env(), cwd=ROOT
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Converted (MLX layout, head in mtp/) float32 fixtures."""
    out = {}
    for layout in ("deepseek_v3", "glm4_moe", "qwen3_5"):
        tmp = tmp_path_factory.mktemp(layout)
        src = build_checkpoint(layout, tmp / "src", dtype="float32")
        convert(str(src), output=tmp / "mlx")
        out[layout] = tmp / "mlx"
    return out


def reference(path: Path, tmp: Path) -> Path:
    """Stock mlx-lm's greedy tokens in this process, as a file the ranks read."""
    model, tokenizer = mlx_lm.load(str(path))
    prompt = tokenizer.encode(PROMPT_TEXT)
    tokens = []
    for r in mlx_lm.stream_generate(model, tokenizer, mx.array(prompt), max_tokens=N_TOKENS + 8):
        if r.finish_reason == "stop":
            break
        tokens.append(r.token)
    out = tmp / "reference.json"
    out.write_text(json.dumps({"prompt": prompt, "tokens": tokens}))
    return out


@pytest.mark.parametrize(
    ("layout", "ranks", "pipeline", "sharding"),
    [
        ("deepseek_v3", 2, True, "pipeline"),
        ("qwen3_5", 2, False, "tensor"),
        ("glm4_moe", 3, True, "pipeline"),
    ],
)
def test_injected_partial_acceptance_on_every_rank(
    models: dict[str, Path], tmp_path: Path, layout: str, ranks: int, pipeline: bool, sharding: str
) -> None:
    """Greedy MTP decoding over the ranks, drafts injected right up to a planned depth each
    round: every rank's tokens are stock mlx-lm's single-process ones, exactly the planned
    drafts are accepted, and every rank's KV caches end at the same position."""
    ref_file = reference(models[layout], tmp_path)
    ref = json.loads(ref_file.read_text())["tokens"]
    done = launch(
        ranks, str(RANK_SCRIPT), str(models[layout]), str(tmp_path), str(int(pipeline)),
        str(N_TOKENS), str(ref_file),
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]
    assert {r["sharding"] for r in results} == {sharding}
    for name in ("1", "2", "1p", "2p"):  # depth, and p: pipelined rounds
        depth = name[0]
        runs = [r["runs"][name] for r in results]
        for run in runs:
            assert run["tokens"] == ref[:N_TOKENS]
        root = runs[0]
        assert root["accepted"] == [min(right, int(depth)) for right in root["plan"]]
        assert 0 < sum(root["accepted"]) < len(root["accepted"]) * int(depth)  # partial
        assert all(run["accepted"] == root["accepted"] for run in runs)
        offsets = {o for run in runs for o in run["offsets"]}
        assert len(offsets) == 1 and offsets.pop() > len(ref) // 2
        # The head runs on rank 0 only under pipeline parallelism, on every rank under tensor.
        assert [run["has_head"] for run in runs] == [True] + [sharding == "tensor"] * (ranks - 1)


def mtpkit_cli() -> str:
    return str(Path(sys.executable).parent / "mtpkit")


def test_generate_cli_under_mlx_launch(models: dict[str, Path], tmp_path: Path) -> None:
    """`mtpkit generate --mtp --json` under mlx.launch: one JSON object (rank 0's), with
    stock mlx-lm's single-process greedy tokens."""
    ref = json.loads(reference(models["deepseek_v3"], tmp_path).read_text())["tokens"]
    done = launch(
        2, mtpkit_cli(), "generate", "--model", str(models["deepseek_v3"]), "-p", PROMPT_TEXT,
        "--no-chat-template", "--max-tokens", str(N_TOKENS), "--mtp", "--depth", "2", "--json",
    )  # fmt: skip
    assert "Error" not in done.stderr, done.stderr
    result = json.loads(done.stdout)  # exactly one object: the other rank printed nothing
    assert result["tokens"] == ref[:N_TOKENS]
    assert result["mtp"] and result["drafted"] > 0


def test_sampled_text_is_one_machines(models: dict[str, Path]) -> None:
    """At a temperature with a seed, pipeline stages give the text one process gives: rank 0
    takes every random draw, in the order one process takes them."""
    from mtpkit.speculative.generate import generate

    path = models["deepseek_v3"]
    args = ["--temp", "1", "--seed", "3", "--depth", "2", "--max-tokens", str(N_TOKENS)]
    done = launch(
        2, mtpkit_cli(), "generate", "--model", str(path), "-p", PROMPT_TEXT, "--no-chat-template",
        "--mtp", "--no-adaptive", "--pipeline", "--json", *args,
    )  # fmt: skip
    assert "Error" not in done.stderr, done.stderr
    one = generate(
        path, PROMPT_TEXT, max_tokens=N_TOKENS, depth=2, temp=1.0, seed=3, adaptive=False,
        chat_template=False,
    )  # fmt: skip
    assert json.loads(done.stdout)["tokens"] == one.tokens


def start_ranks(
    n: int,
    tmp_path: Path,
    *args: str,
    per_rank: dict[int, dict[str, str]] | None = None,
    per_rank_args: dict[int, list[str]] | None = None,
) -> list[subprocess.Popen[str]]:
    """The ranks of a ring, started by hand as mlx.launch starts them (MLX_RANK and a
    hostfile), so that a test can stop or kill one of them or give each its own environment
    (`per_rank`) or its own command line (`per_rank_args`, in place of `args`)."""
    base = free_port_base(n)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(n)]))
    procs = []
    for r in range(n):
        env = rank_env() | {"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)}
        env |= (per_rank or {}).get(r, {})
        procs.append(
            subprocess.Popen(
                [mtpkit_cli(), *(per_rank_args or {}).get(r, args)],
                env=env,
                start_new_session=True,  # `end_rank` ends its supervised child too
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )  # fmt: skip
        )
    return procs


def end_rank(proc: subprocess.Popen[str]) -> None:
    """Kill a hand-started rank and its supervised child (its process group), then reap it:
    a child left alive would hold the pipes open, and the test would wait on them forever."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


def wait_for_output(proc: subprocess.Popen[str], limit: float) -> None:
    """Until rank 0 has printed its first text (decoding is under way)."""
    os.set_blocking(proc.stdout.fileno(), False)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.stdout.read(1):
            return
        if proc.poll() is not None:
            pytest.fail(f"rank 0 ended early: {proc.stderr.read()}")
        time.sleep(0.1)
    pytest.fail("rank 0 printed nothing")


@pytest.mark.parametrize("failure", ["killed", "stopped"])
def test_a_failing_rank_ends_every_rank_with_one_line(
    models: dict[str, Path], tmp_path: Path, failure: str
) -> None:
    """Rank 1 killed (its sockets close) or stopped (a network that silently broke): rank 0
    ends, exit 1, with one `Error: rank 0: ...` line and no traceback (a stopped rank: by
    the watchdog, whose --timeout leaves room for a busy machine's slower rank start)."""
    # Rank 1 runs unsupervised, so that the signal reaches the rank itself.
    procs = start_ranks(
        2, tmp_path, "generate", "--model", str(models["deepseek_v3"]), "-p", PROMPT_TEXT,
        "--no-chat-template", "--max-tokens", "100000", "--mtp", "--timeout", "20",
        per_rank={1: {"MTPKIT_RANK_CHILD": "1"}},
    )  # fmt: skip
    root, other = procs
    try:
        wait_for_output(root, LAUNCH_LIMIT)
        other.send_signal(signal.SIGKILL if failure == "killed" else signal.SIGSTOP)
        root.wait(timeout=LAUNCH_LIMIT)
    finally:
        for p in procs:
            if p.poll() is None:
                end_rank(p)
    lines = [line for line in root.stderr.read().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error: ")]
    assert root.returncode == 1, lines
    assert len(errors) == 1 and errors[0].startswith("Error: rank 0: "), lines
    assert not [line for line in lines if "Traceback" in line or line.startswith("[ring]")]
    if failure == "stopped":
        assert "no progress for" in errors[0]
    else:  # MLX's ring backend raises, at times crashes (reported by the supervisor), or
        # at times waits on the dead socket until the watchdog ends it (seen in CI)
        assert any(
            cause in errors[0]
            for cause in ("lost the connection to another rank", "crashed", "no progress for")
        ), errors


def test_a_family_without_sharding_is_one_line(tmp_path: Path) -> None:
    """mlx-lm's mimo model has neither pipeline() nor shard(): one line says to use one
    machine."""
    from mlx_lm.utils import load_model

    from mtpkit.core.errors import MtpkitError
    from mtpkit.runtime.sharded import choose_mode

    path = build_checkpoint("mimo", tmp_path / "mimo")
    model, config = load_model(path, lazy=True, strict=False)
    with pytest.raises(MtpkitError, match="supports neither pipeline\\(\\) nor shard\\(\\)"):
        choose_mode(model, config, pipeline=False)


def test_bench_under_mlx_launch(models: dict[str, Path]) -> None:
    """`mtpkit bench --json` under mlx.launch: one JSON object (rank 0's), the runs of one
    machine's bench, measured against mlx-lm's own sharded_load."""
    done = launch(
        2, mtpkit_cli(), "bench", "--model", str(models["qwen3_5"]), "--max-tokens", "4",
        "--depth", "1", "--trials", "1", "--json",
    )  # fmt: skip
    assert "Error" not in done.stderr, done.stderr
    result = json.loads(done.stdout)
    assert [r["depth"] for r in result["runs"]] == [1]
    assert result["plain_tps"] > 0 and result["runs"][0]["decode_tps"] > 0


@pytest.fixture
def stalled_listings(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The stand-in Hub's file listings (`/tree`, which `snapshot_download` calls without a
    timeout) never answer while the test runs; the paths asked for are recorded."""
    release = threading.Event()
    asked: list[str] = []
    tree = hub_server._Handler._tree

    def stalled_tree(self, repo, commit, path, query):  # noqa: ANN001, ANN202
        asked.append(path)
        release.wait()
        return tree(self, repo, commit, path, query)

    monkeypatch.setattr(hub_server._Handler, "_tree", stalled_tree)
    yield asked
    release.set()


def test_from_the_hub_each_rank_downloads_its_part(
    hub: HubStandIn, models: dict[str, Path], tmp_path: Path, stalled_listings: list[str]
) -> None:
    """Pipeline stages from a Hub repo, each rank with its own cache: rank 0 (the last stage,
    which runs the head) downloads the head's sidecar, rank 1 does not; the output is stock
    mlx-lm's. No rank lists the repo's files (a stalled listing used to hang every rank): the
    files come from the repo's info and one bounded request each, as for one process."""
    ref = json.loads(reference(models["deepseek_v3"], tmp_path).read_text())["tokens"]
    hub.add_repo("org/tiny-deepseek", models["deepseek_v3"])
    caches = {r: tmp_path / f"hf{r}" for r in range(2)}
    per_rank = {r: {"HF_HOME": str(c), "HF_HUB_CACHE": str(c / "hub")} for r, c in caches.items()}
    procs = start_ranks(
        2, tmp_path, "generate", "--model", "org/tiny-deepseek", "-p", PROMPT_TEXT,
        "--no-chat-template", "--max-tokens", str(N_TOKENS), "--mtp", "--pipeline", "--json",
        per_rank=per_rank,
    )  # fmt: skip
    try:
        outs = [p.communicate(timeout=LAUNCH_LIMIT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                end_rank(p)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert stalled_listings == []
    assert json.loads(outs[0][0])["tokens"] == ref[:N_TOKENS]
    assert outs[1][0] == ""  # rank 1 prints nothing
    fetched = [{f.name for f in c.rglob("*.safetensors")} for c in caches.values()]
    assert "weights.safetensors" in fetched[0] and "weights.safetensors" not in fetched[1]
    assert any(name.startswith("model") for name in fetched[1])


def test_rank_files_of_pipeline_stages(tmp_path: Path) -> None:
    """A stage fetches the shards holding its layers and every tensor outside the layers; the
    head's shard only where the head runs (the raw DeepSeek layout keeps it inline, in the
    last shard)."""
    from mtpkit.runtime.sharded import _rank_files

    path = build_checkpoint("deepseek_v3", tmp_path / "raw", dtype="float32", shards=2)
    config = json.loads((path / "config.json").read_text())
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    head_shards = {f for k, f in index.items() if k.startswith("model.layers.2.")}
    layer0 = {f for k, f in index.items() if k.startswith("model.layers.0.")}
    others = {f for k, f in index.items() if ".layers." not in k}
    first = set(_rank_files(path, config, (0, 1), with_head=False))
    assert layer0 | others <= first
    last = set(_rank_files(path, config, (1, 2), with_head=True))
    assert head_shards <= last
    assert "mtp/weights.safetensors" not in first and "mtp/weights.safetensors" in last
