"""Which runs each `mtpkit bench` trial makes: the head at depths 1..K and adaptively, then
each other proposer's rows (`Plan.configs`).

A draft model's row drafts a fixed number a round, as stock mlx-lm's draft-model row does;
prompt lookup's is chosen adaptively (generate's default). A block drafter (DFlash, EAGLE-3)
gets generate's adaptive row and, asked for, fixed rows at each of `block_depths`; with
`--acceptance` its rows take oracle blocks as the head's take oracle drafts
(`mtpkit.speculative.oracle`: the drafter's pass runs, its block is replaced by the plan).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from mtpkit.core.choices import MAX_DEPTH
from mtpkit.speculative.adaptive import AUTO_MAX_DEPTH

# (depth, adaptive, oracle acceptance or None, proposer): one MTP run of each trial.
Config = tuple[int, bool, float | None, str]
# A proposer's row: (name, depth, adaptive).
Row = tuple[str, int, bool]

BLOCK_DRAFTERS = ("dflash", "eagle3")  # proposers whose rows take oracle blocks
FIXED_DEPTH = ("draft-model", "gemma4-assistant")  # proposers drafting a fixed number


def drafter_rows(names: Iterable[str], num_draft_tokens: int,
                 block_depths: Iterable[int] = ()) -> list[Row]:  # fmt: skip
    """The rows of the proposers `names` besides the head (see the module's text)."""
    rows: list[Row] = []
    for name in names:
        if name in FIXED_DEPTH:
            rows.append((name, min(num_draft_tokens, MAX_DEPTH), False))
            continue
        if name in BLOCK_DRAFTERS:
            rows += [(name, k, False) for k in block_depths]
        rows.append((name, AUTO_MAX_DEPTH, True))
    return rows


@dataclass
class Plan:
    max_tokens: int
    max_depth: int
    trials: int
    acceptances: list[float] | None
    seed: int
    # Proposers besides the head: (name, depth, adaptive) of each one's row.
    drafters: list[Row] = field(default_factory=list)
    head: bool = True
    # One whole trial untimed before the counted ones (bench's default on a GPU).
    warm_trial: bool = False

    def configs(self) -> list[Config]:
        """The MTP runs each trial makes after stock and --no-mtp: depths 1..K and adaptive
        drafting as `generate --mtp` runs it by default (each round's depth chosen, 1 to
        AUTO_MAX_DEPTH), with the head's drafts or at each oracle acceptance; then each
        block drafter's rows, likewise; then each other proposer's row."""
        oracles = self.acceptances if self.acceptances is not None else [None]
        out: list[Config] = []
        for a in oracles if self.head else []:
            out += [(d, False, a, "mtp") for d in range(1, self.max_depth + 1)]
            out.append((AUTO_MAX_DEPTH, True, a, "mtp"))
        blocks = [r for r in self.drafters if r[0] in BLOCK_DRAFTERS]
        for a in oracles:
            out += [(depth, adaptive, a, name) for name, depth, adaptive in blocks]
        others = [r for r in self.drafters if r[0] not in BLOCK_DRAFTERS]
        out += [(depth, adaptive, None, name) for name, depth, adaptive in others]
        return out

    @property
    def deepest(self) -> int:
        """The most drafts any run's round verifies."""
        return max([self.max_depth, AUTO_MAX_DEPTH, *(c[0] for c in self.configs())])


def config_name(config: Config) -> str:
    """How progress lines name a run."""
    depth, adaptive, oracle, drafter = config
    name = f"MTP depth 1-{depth} adaptive" if adaptive else f"MTP depth {depth}"
    if drafter != "mtp":
        name = f"{drafter} {name.removeprefix('MTP ')}"
    return name if oracle is None else f"{name} at oracle acceptance {oracle:g}"
