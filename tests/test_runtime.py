"""The run-time model: one loader for stock mlx-lm's backbone, Hub resolution through
`mtpkit.checkpoint.source`, and verify passes that roll back to any prefix."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from mtpkit.core.errors import MtpkitError
from mtpkit.core.prompts import encode_prompt
from mtpkit.runtime.model import load_backbone, load_model
from mtpkit.speculative.generate import generate
from tests import hub_server
from tests.hub_server import HubStandIn

hub = hub_server.hub  # the fixture; bound by assignment so ruff sees no shadowed import (F811)

EXAMPLE = Path(__file__).resolve().parents[1] / "mtpkit" / "examples" / "tiny-qwen3_5"
PROMPT = "Return a new list of the"


def test_backbone_is_stock_mlx_lm_on_a_raw_checkpoint_with_its_head() -> None:
    """The raw example keeps its head tensors in its shards; setting them aside gives the
    very parameters, config and tokenizer ids that `mlx_lm.load` gives."""
    model, tokenizer, config = load_backbone(EXAMPLE)
    stock, stock_tokenizer, stock_config = mlx_lm.load(str(EXAMPLE), return_config=True)
    ours = dict(tree_flatten(model.parameters()))
    theirs = dict(tree_flatten(stock.parameters()))
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert mx.array_equal(ours[name], value), name
    assert config == stock_config
    assert tokenizer.encode(PROMPT) == stock_tokenizer.encode(PROMPT)
    assert tokenizer.eos_token_ids == stock_tokenizer.eos_token_ids


def test_a_directory_without_weights_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((EXAMPLE / "config.json").read_text())
    with pytest.raises(MtpkitError, match="mlx-lm cannot load"):
        load_model(tmp_path)
    with pytest.raises(MtpkitError, match="no config.json"):
        load_model(tmp_path.parent)


@pytest.mark.parametrize("kept", [1, 2, 3])
def test_verify_rolls_back_to_any_prefix(converted: Path, kept: int) -> None:
    """After a 3-token verify pass rolled back to `kept` tokens (KV caches trimmed,
    gated-delta-net states restored), the next token's logits are stock mlx-lm's over the
    whole sequence without any cache."""
    m = load_model(converted)
    prompt = encode_prompt(m.tokenizer, PROMPT)
    cache = m.make_cache()
    m.forward(mx.array(prompt[:-1])[None], cache)
    verify = [prompt[-1], 11, 42]
    verified = m.verify(mx.array(verify), cache)
    assert verified.snapshots is not None and verified.snapshots.states
    verified.rollback(cache, kept)
    following = 7
    logits, _ = m.forward(mx.array([[following]]), cache)
    sequence = prompt[:-1] + verify[:kept] + [following]
    stock, _ = mlx_lm.load(str(converted))
    expected = stock(mx.array(sequence)[None])[0, -1]
    assert mx.allclose(logits[0, -1], expected, atol=1e-3, rtol=1e-3)


def test_generate_from_a_hub_repo(hub: HubStandIn, converted: Path) -> None:
    """A repo id is fetched through `mtpkit.checkpoint.source` (the real client against a loopback
    Hub) and decodes exactly as the local directory does; an unknown repo is one line."""
    hub.add_repo("acme/tiny-mtp", converted)
    local = generate(converted, PROMPT, max_tokens=12, depth=2, adaptive=False)
    remote = generate("acme/tiny-mtp", PROMPT, max_tokens=12, depth=2, adaptive=False)
    assert remote.tokens == local.tokens and remote.drafted > 0
    assert "acme/tiny-mtp/mtp/weights.safetensors" in hub.bytes_served
    with pytest.raises(MtpkitError, match="no Hub repo acme/missing"):
        load_model("acme/missing")
