"""config.json as mlx-lm writes and reads it: `mlx_lm.utils.save_config`/`load_config` are
the reference, also through a whole conversion and a graft."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from mlx_lm.utils import load_config, save_config

from mtpkit.convert.grafting import graft
from mtpkit.convert.pipeline import convert
from mtpkit.convert.writer import read_config, write_config

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"


def _strict_json(text: str):
    def refuse(constant: str):
        raise AssertionError(f"bare {constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_write_config_matches_mlx_lm_save_config(tmp_path):
    config = {
        "model_type": "x",
        "_name_or_path": "somewhere",
        "vision_config": {"a": 1},
        "quantization": {"bits": 4, "group_size": 64},
        "nested": {"lo": -math.inf, "values": [1.5, math.nan, math.inf]},
        "big": 1e300,
    }
    save_config(json.loads(json.dumps(config)), tmp_path / "stock.json")
    write_config(tmp_path / "mine.json", config)
    assert (tmp_path / "mine.json").read_bytes() == (tmp_path / "stock.json").read_bytes()
    _strict_json((tmp_path / "mine.json").read_text())
    (tmp_path / "dir").mkdir()
    shutil.copy(tmp_path / "mine.json", tmp_path / "dir" / "config.json")
    mine, stock = read_config(tmp_path / "dir" / "config.json"), load_config(tmp_path / "dir")
    assert math.isnan(mine["nested"]["values"][1]) and math.isnan(stock["nested"]["values"][1])
    assert mine["nested"]["lo"] == stock["nested"]["lo"] == -math.inf


@pytest.fixture
def nan_source(tmp_path: Path) -> Path:
    """The bundled example with a non-finite value in its config (as bare JSON NaN)."""
    src = tmp_path / "src"
    shutil.copytree(EXAMPLE, src)
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["router_aux_loss_coef"] = float("nan")
    (src / "config.json").write_text(json.dumps(config, indent=2))
    return src


def test_convert_and_graft_write_configs_mlx_lm_reads_back(nan_source, tmp_path):
    out = tmp_path / "out"
    convert(str(nan_source), output=out)
    written = _strict_json((out / "config.json").read_text())
    assert written["text_config"]["router_aux_loss_coef"] == {"__float__": "NaN"}
    assert math.isnan(load_config(out)["text_config"]["router_aux_loss_coef"])
    graft(str(nan_source), into=out, force=True)
    _strict_json((out / "config.json").read_text())
    assert math.isnan(load_config(out)["text_config"]["router_aux_loss_coef"])
    again = tmp_path / "again"
    convert(str(out), output=again)
    assert _strict_json((again / "config.json").read_text()) == _strict_json(
        (out / "config.json").read_text()
    )
