"""The tensor rules of `mtpkit.convert.rules`, against numpy float32 computed independently."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mtpkit.convert.rules import conv1d_to_mlx, shift_norms, stack_experts


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def test_stack_experts_per_expert_weights_scales_and_biases():
    rng = np.random.default_rng(0)
    source = {}
    for e in (2, 0, 1):  # out of order: stacking follows the expert index
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for part in ("weight", "scales", "biases"):
                name = f"layers.0.mlp.experts.{e}.{proj}.{part}"
                source[name] = rng.standard_normal((4, 8)).astype(np.float32)
    source["layers.0.mlp.gate.weight"] = rng.standard_normal((3, 8)).astype(np.float32)
    out = stack_experts({k: mx.array(v) for k, v in source.items()})
    assert set(out) == {"layers.0.mlp.gate.weight"} | {
        f"layers.0.mlp.switch_mlp.{proj}.{part}"
        for proj in ("gate_proj", "up_proj", "down_proj")
        for part in ("weight", "scales", "biases")
    }
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for part in ("weight", "scales", "biases"):
            expected = np.stack(
                [source[f"layers.0.mlp.experts.{e}.{proj}.{part}"] for e in range(3)]
            )
            np.testing.assert_array_equal(
                _np(out[f"layers.0.mlp.switch_mlp.{proj}.{part}"]), expected
            )
    np.testing.assert_array_equal(
        _np(out["layers.0.mlp.gate.weight"]), source["layers.0.mlp.gate.weight"]
    )


def test_stack_experts_splits_fused_and_is_idempotent():
    rng = np.random.default_rng(1)
    gate_up = rng.standard_normal((3, 2 * 5, 8)).astype(np.float32)  # [E, 2I, H]
    down = rng.standard_normal((3, 8, 5)).astype(np.float32)  # [E, H, I]
    out = stack_experts(
        {
            "mtp.layers.0.mlp.experts.gate_up_proj": mx.array(gate_up),
            "mtp.layers.0.mlp.experts.down_proj": mx.array(down),
        }
    )
    np.testing.assert_array_equal(
        _np(out["mtp.layers.0.mlp.switch_mlp.gate_proj.weight"]), gate_up[:, :5, :]
    )
    np.testing.assert_array_equal(
        _np(out["mtp.layers.0.mlp.switch_mlp.up_proj.weight"]), gate_up[:, 5:, :]
    )
    np.testing.assert_array_equal(_np(out["mtp.layers.0.mlp.switch_mlp.down_proj.weight"]), down)
    again = stack_experts(out)
    assert set(again) == set(out)
    for k in out:
        np.testing.assert_array_equal(_np(again[k]), _np(out[k]))


def test_shift_norms_adds_one_in_float32_to_the_named_norms_only():
    rng = np.random.default_rng(2)
    w = rng.standard_normal(16).astype(np.float32) * 0.05
    weights = {
        "layers.0.input_layernorm.weight": mx.array(w).astype(mx.bfloat16),
        "pre_fc_norm_hidden.weight": mx.array(w).astype(mx.bfloat16),
        "layers.0.linear_attn.norm.weight": mx.array(w).astype(mx.bfloat16),  # not named
        "fc.weight": mx.array(rng.standard_normal((4, 4)).astype(np.float32)),
    }
    out = shift_norms(weights, ("input_layernorm.weight", "pre_fc_norm_hidden.weight"))
    bf16 = _np(mx.array(w).astype(mx.bfloat16))
    # numpy float32 +1, then one rounding to bfloat16
    expected = _np(mx.array(bf16 + np.float32(1.0)).astype(mx.bfloat16))
    for name in ("layers.0.input_layernorm.weight", "pre_fc_norm_hidden.weight"):
        assert out[name].dtype == mx.bfloat16
        np.testing.assert_array_equal(_np(out[name]), expected)
    np.testing.assert_array_equal(_np(out["layers.0.linear_attn.norm.weight"]), bf16)
    np.testing.assert_array_equal(_np(out["fc.weight"]), _np(weights["fc.weight"]))


def test_conv1d_to_mlx_moves_the_kernel_axis_once():
    raw = np.arange(6 * 4, dtype=np.float32).reshape(6, 1, 4)  # HF [C, 1, K]
    once = conv1d_to_mlx("linear_attn.conv1d.weight", mx.array(raw))
    np.testing.assert_array_equal(_np(once), np.transpose(raw, (0, 2, 1)))
    twice = conv1d_to_mlx("linear_attn.conv1d.weight", once)
    np.testing.assert_array_equal(_np(twice), _np(once))
