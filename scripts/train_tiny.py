"""Train the tiny Qwen3.5 model with an MTP head that ships in `mtpkit/examples/`.

Random weights make MTP acceptance meaningless, so mtpkit's tests and README example use a
small model that has learnt something: English docstrings from Python's own standard
library. It has the real Qwen3.5 dense layout (three gated-delta-net layers and one
full-attention layer, built with mlx-lm's `qwen3_5` model class), a real byte-level BPE
tokenizer, and an MTP head (mtpkit's `heads` module) trained jointly to predict the token
after next from the backbone's post-final-norm hidden state.

The output is a RAW Hugging Face checkpoint, as a Hub repo of the family holds it:
`model.language_model.*` plus top-level `mtp.*`, zero-centred RMSNorm weights (stored
weight = gamma - 1), conv1d in the HF layout, BF16, two shards with an index, and
`text_config.mtp_num_hidden_layers: 1`. Held-out docstrings (modules never trained on) go
to `heldout.txt` next to it.

    python scripts/train_tiny.py [--out mtpkit/examples/tiny-qwen3_5] [--steps 700]

It takes about half an hour on two CPU cores (700 steps of 16 x 64 tokens; MLX's CPU backend
multiplies at a few GFLOP/s). The result depends on the Python version whose
standard library supplies the text; the committed checkpoint was trained on CPython 3.11.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtpkit.runtime.headload import build_head  # noqa: E402

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SEQ_LEN = 64
BATCH = 16
MTP_LOSS_WEIGHT = 0.5
# Zero-centred norms (the model applies 1 + w), as Qwen3.5 stores them; `linear_attn.norm`
# is a plain gamma and is never shifted.
ZERO_CENTRED_SUFFIXES = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)


def config() -> dict:
    text = {
        "attention_bias": False,
        "attn_output_gate": True,
        "bos_token_id": 0,
        "dtype": "bfloat16",
        "eos_token_id": 0,
        "full_attention_interval": 4,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 128,
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 32,
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 4096,
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [2, 1, 1],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": True,
        "transformers_version": "5.2.0",
    }


# ------------------------------------------------------------------------------ the text


def stdlib_docstrings() -> tuple[list[str], list[str]]:
    """Docstrings of the standard library, split by module into train and held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train: list[str] = []
    held: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(
            part in rel for part in ("test", "site-packages", "idlelib", "lib2to3", "turtledemo")
        ):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [tree] + [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        ]
        docs = []
        for node in nodes:
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 60 and doc.isascii():
                docs.append(" ".join(doc.split()))
        bucket = int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 20
        (held if bucket == 0 else train).extend(docs)
    return train, held


def train_tokenizer(texts: list[str], out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token=None,
        pad_token="<|endoftext|>",
        model_max_length=4096,
    )
    fast.save_pretrained(str(out))


# ------------------------------------------------------------------------------ the model


class TinyWithMtp(nn.Module):
    """mlx-lm's Qwen3.5 model plus mtpkit's head, trained with one joint loss."""

    def __init__(self, cfg: dict) -> None:
        super().__init__()
        from mlx_lm.models import qwen3_5

        self.backbone = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(cfg))
        self.mtp = build_head(cfg, 1)

    def losses(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        text = self.backbone.language_model
        hidden = text.model(tokens[:, :-1])  # post-final-norm hidden states
        embed = text.model.embed_tokens
        logits = embed.as_linear(hidden)
        lm = nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="mean")
        # The head at position k sees h_k and the embedding of t_{k+1}; it predicts t_{k+2}.
        x = self.mtp(hidden[:, :-1], embed(tokens[:, 1:-1]))
        mtp_logits = embed.as_linear(self.mtp.final_norm(0)(x))
        mtp = nn.losses.cross_entropy(mtp_logits, tokens[:, 2:], reduction="mean")
        return lm, mtp


def hf_weights(model: TinyWithMtp) -> dict[str, mx.array]:
    """The raw Hugging Face names, layouts and zero-centred norms."""
    out: dict[str, mx.array] = {}
    for name, value in tree_flatten(model.backbone.parameters()):
        key = name.replace("language_model.model.", "model.language_model.", 1)
        out[key] = value
    for name, value in tree_flatten(model.mtp.parameters()):
        out[f"mtp.{name}"] = value
    for key, value in list(out.items()):
        if "conv1d.weight" in key:
            out[key] = value.moveaxis(2, 1)  # mlx [C, K, 1] -> HF [C, 1, K]
        zero_centred = key.endswith(ZERO_CENTRED_SUFFIXES) or key in (
            "model.language_model.norm.weight",
            "mtp.norm.weight",
        )
        if zero_centred:
            out[key] = value - 1.0
    return {k: v.astype(mx.float32 if k.endswith("A_log") else mx.bfloat16) for k, v in out.items()}


def write_checkpoint(
    model: TinyWithMtp, cfg: dict, out: Path, tok_dir: Path, held: list[str]
) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))
    tmp.chmod(0o755)
    weights = hf_weights(model)
    shard_names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    # Like the published checkpoints, the head sits in the last shard.
    shards: list[dict[str, mx.array]] = [{}, {}]
    for k, v in weights.items():
        second = k.startswith("mtp.") or k.startswith("model.language_model.layers.3")
        shards[1 if second else 0][k] = v
    weight_map = {}
    total = 0
    for name, tensors in zip(shard_names, shards, strict=True):
        mx.save_safetensors(str(tmp / name), tensors, metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for f in tok_dir.iterdir():
        shutil.copy(f, tmp / f.name)
    (tmp / "heldout.txt").write_text("\n".join(held) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def batches(ids: np.ndarray, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(ids) - SEQ_LEN - 1, size=BATCH)
        yield mx.array(np.stack([ids[s : s + SEQ_LEN + 1] for s in starts]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", default=str(Path(__file__).resolve().parents[1] / "mtpkit/examples/tiny-qwen3_5")
    )
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    train_docs, held_docs = stdlib_docstrings()
    print(f"{len(train_docs)} training docstrings, {len(held_docs)} held out", file=sys.stderr)
    tok_dir = Path(tempfile.mkdtemp(prefix="tiny-tok-"))
    train_tokenizer(train_docs, tok_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for doc in train_docs:
        ids.extend(tokenizer.encode(doc))
        ids.append(eos)
    data = np.array(ids, dtype=np.int32)
    print(f"{len(data)} training tokens", file=sys.stderr)

    cfg = config()
    model = TinyWithMtp(cfg)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"{n_params / 1e6:.2f}M parameters", file=sys.stderr)
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(1e-5, args.lr, 100),
            optim.cosine_decay(args.lr, max(args.steps - 100, 1), 1e-4),
        ],
        [100],
    )
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.01)

    def loss_fn(m: TinyWithMtp, tokens: mx.array) -> mx.array:
        lm, mtp = m.losses(tokens)
        return lm + MTP_LOSS_WEIGHT * mtp, (lm, mtp)

    grad_fn = nn.value_and_grad(model, lambda m, t: loss_fn(m, t)[0])
    state = [model.state, opt.state]

    def step(tokens: mx.array) -> mx.array:
        loss, grads = grad_fn(model, tokens)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    step = mx.compile(step, inputs=state, outputs=state)
    model.train()
    start = time.time()
    it = batches(data, rng)
    for i in range(1, args.steps + 1):
        loss = step(next(it))
        mx.eval(state, loss)
        if i % 100 == 0 or i == 1:
            lm, mtp = loss_fn(model, next(it))[1]
            print(
                f"step {i}: loss {loss.item():.3f} (lm {lm.item():.3f} ppl {math.exp(lm.item()):.1f}, "
                f"mtp {mtp.item():.3f}) {time.time() - start:.0f}s",
                file=sys.stderr,
            )
    model.eval()
    write_checkpoint(model, cfg, out, tok_dir, held_docs[:200])
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.1f} MB)", file=sys.stderr)


if __name__ == "__main__":
    main()
