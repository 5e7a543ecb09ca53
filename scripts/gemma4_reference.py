"""Compute the Gemma 4 assistant's reference draft logits with transformers (torch, CPU).

    .venv/bin/pip install torch==2.13.0     # CPU wheel; transformers >= 5.23 has gemma4_assistant
    .venv/bin/python scripts/gemma4_reference.py

Builds the tiny target and assistants of `tests/gemma4_checkpoints.py` (float32, fixed seeds),
loads them into transformers' `Gemma4ForCausalLM` and `Gemma4AssistantForCausalLM` with strict
key checks, prefills each prompt, and drafts as transformers'
`SinglePositionMultiTokenCandidateGenerator` does (greedy, `STEPS` steps). Writes
`tests/references/gemma4_assistant.npz`, which `tests/test_gemma4.py` compares mtpkit's MLX
assistant against: torch is not part of the test extra, so the reference is computed once here.
"""

from __future__ import annotations

import glob
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import (
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.gemma4_checkpoints import build_assistant, build_target  # noqa: E402

OUT = ROOT / "tests" / "references" / "gemma4_assistant.npz"
STEPS = 3
ASSISTED_TOKENS = 32
# A prompt inside the sliding window (8) and one past it (the sliding layers then see only
# the newest window + 1 entries).
PROMPTS = {
    "short": [5, 17, 100, 3, 250, 42],
    "long": [5, 17, 100, 3, 250, 42, 7, 9, 300, 11, 64, 128, 77, 301, 23],
}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(glob.glob(str(path / "*.safetensors"))):
        out.update(load_file(shard))
    return out


def _load_strict(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    result = model.load_state_dict(tensors, strict=False)
    # The tied output head is the one expected absentee.
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise SystemExit(
            f"fixture names drifted: missing {missing}, extra {result.unexpected_keys}"
        )
    model.tie_weights()


def load_target(path: Path) -> Gemma4ForCausalLM:
    config = json.loads((path / "config.json").read_text())["text_config"]
    model = Gemma4ForCausalLM(Gemma4TextConfig(**config)).float().eval()
    prefix = "model.language_model."
    tensors = {
        "model." + k.removeprefix(prefix): v
        for k, v in _tensors(path).items()
        if k.startswith(prefix)
    }
    _load_strict(model, tensors)
    return model


def load_assistant(path: Path) -> Gemma4AssistantForCausalLM:
    config = Gemma4AssistantConfig(**json.loads((path / "config.json").read_text()))
    model = Gemma4AssistantForCausalLM(config).float().eval()
    _load_strict(model, _tensors(path))
    return model


@torch.no_grad()
def draft(target, assistant, prompt: list[int]) -> dict[str, np.ndarray]:
    """Prefill, then STEPS greedy draft steps from the bonus token (transformers' rules)."""
    ids = torch.tensor([prompt])
    out = target(
        input_ids=ids, output_hidden_states=True, return_shared_kv_states=True, use_cache=False
    )
    bonus = int(out.logits[0, -1].argmax())
    hidden = out.hidden_states[-1][:, -1:]
    shared = out.shared_kv_states
    position = torch.tensor([[len(prompt)]])  # the bonus token's index
    token = torch.tensor([[bonus]])
    logits, tokens = [], []
    for _ in range(STEPS):
        embedded = target.get_input_embeddings()(token)  # scaled by sqrt(hidden)
        step = assistant(
            inputs_embeds=torch.cat([embedded, hidden], dim=-1),
            position_ids=position,
            shared_kv_states=shared,
            use_cache=False,
        )
        token = step.logits.argmax(dim=-1)
        hidden = step.last_hidden_state
        logits.append(step.logits[0, 0].numpy())
        tokens.append(int(token))
    return {
        "target_logits": out.logits[0, -1].numpy(),
        "bonus": np.array(bonus),
        "draft_logits": np.stack(logits),
        "draft_tokens": np.array(tokens),
    }


@torch.no_grad()
def assisted_generation(target, assistant, prompt: list[int]) -> dict[str, np.ndarray]:
    """transformers' own assisted generation (greedy, `STEPS` drafts a round): the output,
    and each round's (input length, drafts) as its candidate generator drafted them."""
    from transformers.generation import candidate_generator

    generator = candidate_generator.SinglePositionMultiTokenCandidateGenerator
    original = generator.get_candidates
    rounds: list[tuple[int, list[int]]] = []

    def recorded(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        if logits is not None:
            rounds.append((input_ids.shape[1], ids[0, input_ids.shape[1] :].tolist()))
        return ids, logits

    generator.get_candidates = recorded
    try:
        assistant.generation_config.num_assistant_tokens = STEPS
        out = target.generate(
            torch.tensor([prompt]), assistant_model=assistant, max_new_tokens=ASSISTED_TOKENS,
            do_sample=False,
        )  # fmt: skip
    finally:
        generator.get_candidates = original
    drafts = np.full((len(rounds), STEPS), -1)
    for i, (_, tokens) in enumerate(rounds):
        drafts[i, : len(tokens)] = tokens
    return {
        "output": out[0, len(prompt) :].numpy(),
        "positions": np.array([position for position, _ in rounds]),
        "drafts": drafts,
    }


def main() -> None:
    arrays: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        # A pair that agrees on most steps (`two_token`): rounds keep drafts and reject some.
        target = load_target(build_target(Path(tmp) / "agreeing_target", agreeing=True))
        assistant = load_assistant(build_assistant(Path(tmp) / "agreeing", agreeing=True))
        arrays["assisted/prompt"] = np.array(PROMPTS["long"][:12])
        for key, value in assisted_generation(target, assistant, PROMPTS["long"][:12]).items():
            arrays[f"assisted/{key}"] = value
        target = load_target(build_target(Path(tmp) / "target"))
        for head, ordered in (("dense", False), ("masked", True)):
            assistant = load_assistant(build_assistant(Path(tmp) / head, ordered=ordered))
            for name, prompt in PROMPTS.items():
                arrays[f"{name}/prompt"] = np.array(prompt)
                for key, value in draft(target, assistant, prompt).items():
                    arrays[f"{name}/{head}/{key}"] = value
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT.relative_to(ROOT)} ({len(arrays)} arrays)")


if __name__ == "__main__":
    main()
