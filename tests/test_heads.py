"""MTP heads for every family and layout, on tiny random checkpoints in the published formats.

Random heads are (almost) never accepted, so these runs exercise the rejection path: KV
caches trimmed and gated-delta-net states restored from the verify pass's snapshots, every
round. `test_injected_drafts_*` then feeds the verifier drafts that are right up to a chosen
depth, which exercises every partial acceptance.
"""

from __future__ import annotations

import io
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

from mtpkit.convert.pipeline import convert
from mtpkit.runtime.headload import EMBEDDING_FIRST, HIDDEN_FIRST, build_head, supported_families
from mtpkit.speculative.generate import MtpDecoder, SamplingSettings, generate, load_model
from tests.checkpoints import MLX_LAYOUTS, RAW_WITH_MTP, build_checkpoint, dtype_for
from tests.injected import accepted_per_round, inject_drafts, planned_per_round
from tests.stock import stock_tokens

PROMPT = list(range(5, 21))


def converted_dir(tmp: Path, layout: str, **convert_args) -> Path:
    src = build_checkpoint(layout, tmp / "src", dtype=dtype_for(layout))
    if layout in MLX_LAYOUTS:
        return src
    out = tmp / "mlx"
    convert(str(src), output=out, **convert_args)
    return out


def test_every_family_has_a_head() -> None:
    assert {"qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "glm4_moe", "mimo"} <= set(
        supported_families()
    )


@pytest.mark.parametrize("layout", [*RAW_WITH_MTP, "mlx_inline"])
def test_head_loads_strictly_and_greedy_is_lossless(tmp_path: Path, layout: str) -> None:
    path = converted_dir(tmp_path, layout)
    m = load_model(path)
    assert m.head is not None
    assert m.head.concat_order == (HIDDEN_FIRST if layout == "mimo" else EMBEDDING_FIRST)
    assert m.head_weights.layout == ("inline" if layout == "mlx_inline" else "sidecar")
    reference = stock_tokens(path, PROMPT, 12)
    result = generate(m, PROMPT, max_tokens=12, depth=3, adaptive=False)
    assert result.tokens == reference
    assert result.drafted > 0


def test_quantized_sidecar_head(tmp_path: Path) -> None:
    path = converted_dir(tmp_path, "qwen3_5", bits=4, group_size=32)
    m = load_model(path)
    assert any(k.endswith(".scales") for k in m.head_weights.weights)
    result = generate(m, PROMPT, max_tokens=10, depth=2, adaptive=False)
    assert result.tokens == stock_tokens(path, PROMPT, 10)


def test_build_head_rejects_unknown_family() -> None:
    from mtpkit.core.errors import UnsupportedFamily

    with pytest.raises(UnsupportedFamily, match="supported: "):
        build_head({"model_type": "gpt2"})


@pytest.mark.parametrize("pipeline", [False, True, "build"], ids=["serial", "pipelined", "built"])
@pytest.mark.parametrize(
    "layout", ["qwen3_5", "qwen3_next", "exaone_moe", "mimo_v2_flash", "step3p5", "nemotron_h"]
)
def test_injected_drafts_partial_acceptance_keeps_caches_exact(
    tmp_path: Path, layout: str, pipeline: bool | str
) -> None:
    """Drafts right up to depth j (then wrong) for every j in 0..4: the output must stay the
    backbone's, and exactly j drafts must be accepted each round. Pipelined: every round
    queues the next before its verdict is read (built: builds it, launched only after a full
    round), so each partial round discards a queued one
    (gated-delta-net states, sliding windows (exaone, mimo_v2_flash, step3p5: window 8),
    Mamba states, KV caches all taken back across the round boundary)."""
    path = converted_dir(tmp_path, layout)
    m = load_model(path)
    n = 40
    reference = stock_tokens(path, PROMPT, n)
    assert len(reference) == n
    decoder = MtpDecoder(
        m, PROMPT, depth=4, sampling=SamplingSettings(), adaptive=False, pipeline=pipeline
    )
    vocab = m.embedding.weight.shape[0]
    plan = [0, 4, 1, 3, 2, 4, 4, 0, 2, 1, 3] * 10
    rights = inject_drafts(decoder, reference, plan, vocab)
    assert list(decoder.tokens(n)) == reference
    accepted = accepted_per_round(decoder)
    assert accepted == planned_per_round(decoder, rights)
    assert set(accepted) == {0, 1, 2, 3, 4}
    if pipeline:  # queued rounds were both used (after a full round) and discarded
        used = decoder.stats.pipelined - decoder.stats.discarded
        assert decoder.stats.discarded > 0 and used > 0
        launched = decoder.stats.launched_ahead
        assert launched == (decoder.stats.pipelined if pipeline is True else 0)
    else:
        assert decoder.stats.pipelined == 0


@pytest.mark.parametrize("layout", ["qwen3_5", "mimo_v2_flash"])
def test_a_discarded_unlaunched_round_leaves_nothing_to_compute(
    tmp_path: Path, layout: str
) -> None:
    """A round built ahead but not launched, then discarded, leaves every cache (the
    backbone's KV, gated-delta-net and sliding-window caches, the head's) holding the very
    arrays it held before: no lazy write of the discarded pass stays behind to be computed
    with the next one."""
    m = load_model(converted_dir(tmp_path, layout))
    decoder = MtpDecoder(m, PROMPT, depth=2, sampling=SamplingSettings(), adaptive=False)
    decoder.prefill()
    last = mx.array([PROMPT[-1]], dtype=mx.int32)
    r = decoder.build_round(last, len(PROMPT), False)
    caches = decoder.cache + decoder.proposer.caches()
    mx.eval(r.packed, r.state, [c.state for c in caches])

    def arrays() -> list[mx.array]:
        found = []
        for c in caches:
            for v in vars(c).values():
                found += [x for x in (v if isinstance(v, list) else [v]) if isinstance(x, mx.array)]
        return found

    def pending(a: mx.array) -> int:  # graph nodes not computed yet behind `a`
        out = io.StringIO()
        mx.export_to_dot(out, a)
        return out.getvalue().count("shape=rectangle")

    before = [np.array(a.astype(mx.float32)) for a in arrays()]
    decoder.proposer.assume_kept(r.state)
    queued = decoder.build_round(r.followers[-1:], r.position + 3, True, launch=False)
    assert not queued.launched and sum(pending(a) for a in arrays()) > 0
    decoder.discard(queued)
    after = arrays()
    assert [pending(a) for a in after] == [0] * len(after)
    assert len(after) == len(before)
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(np.array(a.astype(mx.float32)), b)


def test_rounds_look_ahead_by_the_share_of_full_rounds_and_serial_timings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU (pipeline None) no round is looked ahead before one kept every draft and
    three serial rounds are timed; then a device slower than the host's build launches
    ahead while most rounds keep every draft and builds ahead below, and a host slower than
    the device builds ahead only while the few discards cost less than the waits it saves
    (`look_ahead.look_ahead_by_cost`); never where no more tokens are wanted. Across ranks
    (untimed) the share alone decides."""
    from mtpkit.speculative import look_ahead

    m = load_model(converted_dir(tmp_path, "qwen3_5"))
    decoder = MtpDecoder(m, PROMPT, depth=1, sampling=SamplingSettings(), adaptive=False)
    assert decoder.look.mode is False and decoder._look_ahead(True) is None  # the CPU: serial
    look = decoder.look = look_ahead.LookAhead(None)  # as on a GPU
    look.full_share = 0.99
    assert decoder._look_ahead(True) is None  # no round has kept every draft yet
    look.full_rounds = 1
    for _ in range(look_ahead.TIMED_ROUNDS - 1):
        look.record_serial(0.002, 0.004)
    assert decoder._look_ahead(True) is None  # not timed enough yet
    look.record_serial(0.002, 0.004)
    seen = {}
    for share in (0.99, look_ahead.PIPELINE_MIN_FULL, 0.9, 0.3):  # the device is the slower
        look.full_share = share
        seen[share] = decoder._look_ahead(True)
        assert decoder._look_ahead(False) is None
    assert seen == {
        0.99: "launch",
        look_ahead.PIPELINE_MIN_FULL: "launch",
        0.9: "build",
        0.3: "build",
    }
    for _ in range(look_ahead.TIMING_WINDOW):  # the host is: a build 2 ms, a wait 0.1 ms
        look.record_serial(0.002, 0.0001)
    seen = {}
    for share in (0.99, 0.96, 0.9, 0.5):  # builds ahead while 0.1 p > 1.9 (1 - p): p > 0.95
        look.full_share = share
        seen[share] = decoder._look_ahead(True)
    assert seen == {0.99: "build", 0.96: "build", 0.9: None, 0.5: None}
    monkeypatch.setattr(look_ahead, "BUILD_MIN_FULL", None)  # no building ahead
    look.full_share = 0.99
    assert decoder._look_ahead(True) is None
    untimed = look_ahead.LookAhead(None, timed=False, full_rounds=1)  # ranks in lockstep
    monkeypatch.setattr(look_ahead, "BUILD_MIN_FULL", 0.5)
    seen = {}
    for share in (1.0, look_ahead.PIPELINE_MIN_FULL, 0.9, 0.5, 0.49):
        untimed.full_share = share
        seen[share] = untimed.choose()
    assert seen == {1.0: "launch", look_ahead.PIPELINE_MIN_FULL: "launch", 0.9: "build",
                    0.5: "build", 0.49: None}  # fmt: skip
    for mode, chosen in ((True, "launch"), ("build", "build"), (False, None)):  # forced
        assert look_ahead.LookAhead(mode).choose() == chosen


def test_a_deciding_decoder_times_its_serial_rounds(tmp_path: Path) -> None:
    """A decoder that decides its look-ahead (pipeline None, as on a GPU) times the rounds
    it runs serially, and decodes exactly what a serial decoder decodes."""
    from mtpkit.speculative import look_ahead

    m = load_model(converted_dir(tmp_path, "qwen3_5"))
    serial = MtpDecoder(m, PROMPT, depth=2, sampling=SamplingSettings(), adaptive=False)
    expected = list(serial.tokens(24))
    deciding = MtpDecoder(m, PROMPT, depth=2, sampling=SamplingSettings(), adaptive=False)
    deciding.look = look_ahead.LookAhead(None)  # as on a GPU
    assert list(deciding.tokens(24)) == expected
    timed = len(deciding.look.builds)
    assert timed >= min(look_ahead.TIMED_ROUNDS, deciding.stats.rounds)
    assert all(b > 0 for b in deciding.look.builds) and all(w >= 0 for w in deciding.look.waits)
    assert deciding.stats.rounds - deciding.stats.pipelined >= timed


def test_vllm_mlx_qwen3_next_head_file_beside_the_shards(tmp_path: Path) -> None:
    """vllm-mlx puts the Qwen3-Next head in `model-mtp.safetensors`, which stock mlx-lm's
    loader reads and rejects; the backbone still loads (strictly) and the head is found."""
    path = converted_dir(tmp_path, "qwen3_next")
    head = mx.load(str(path / "mtp" / "weights.safetensors"))
    mx.save_safetensors(str(path / "model-mtp.safetensors"), head)
    for f in (path / "mtp").iterdir():
        f.unlink()
    (path / "mtp").rmdir()
    (path / "mtp.safetensors").unlink()  # mtpkit's copy for the other runtimes: not vllm-mlx's
    with pytest.raises(ValueError, match="mtp"):
        mlx_lm.load(str(path))
    m = load_model(path)
    assert m.head is not None and m.head_weights.files == ["model-mtp.safetensors"]
    plain = generate(m, PROMPT, max_tokens=8, mtp=False)
    drafted = generate(m, PROMPT, max_tokens=8, depth=2, adaptive=False)
    assert drafted.tokens == plain.tokens and drafted.drafted > 0


@pytest.mark.parametrize("norms", ["mlx_gamma", "zero_centred"])
def test_vllm_mlx_qwen3_5_sidecar(tmp_path: Path, norms: str) -> None:
    """vllm-mlx's Qwen3.5 sidecar: `mtp/weights.safetensors` under `mtp.*` names and a
    manifest of its own (no `format: mtpkit`) whose `rmsnorm_weight_format` says whether
    the norms are shifted yet."""
    import json

    path = converted_dir(tmp_path, "qwen3_5")
    ours = load_model(path)
    expected = dict(ours.head_weights.weights)
    sidecar = {}
    for k, v in expected.items():
        module = k.removesuffix(".weight").rsplit(".", 1)[-1]
        if norms == "zero_centred" and v.ndim == 1 and "norm" in module:
            v = (v.astype(mx.float32) - 1.0).astype(v.dtype)
        sidecar[f"mtp.{k}"] = v
    mx.save_safetensors(str(path / "mtp" / "weights.safetensors"), sidecar)
    (path / "mtp" / "manifest.json").write_text(
        json.dumps({"rmsnorm_weight_format": norms, "num_mtp_layers": 1})
    )
    m = load_model(path)
    assert m.head_weights.prefix == "mtp."
    for k, v in expected.items():
        assert mx.allclose(
            m.head_weights.weights[k].astype(mx.float32), v.astype(mx.float32), atol=1e-2
        )
    prompt = list(range(5, 21))
    assert generate(m, prompt, max_tokens=10, depth=2, adaptive=False).tokens == stock_tokens(
        path, prompt, 10
    )
