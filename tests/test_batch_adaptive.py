"""The probe schedule of adaptive drafting per batch width (`speculative/batch/adaptive.py`):
which steps draft, given timings that make one mode cheaper. The positions are written out by
hand from the schedule the module states (first rounds, a plain probe, then probes whose wait
doubles while the choice holds)."""

from mtpkit.speculative.batch.adaptive import (
    FIRST_ROUNDS,
    MAX_REPROBE_EVERY,
    PROBE_STEPS,
    REPROBE_EVERY,
    USELESS_EVERY,
    WidthDrafting,
)

WIDTH = 4


def drafting_steps(policy: WidthDrafting, steps: int, cost) -> list[int]:
    """Run `steps` steps at WIDTH; `cost(i, drafted)` gives (seconds, tokens) of step i.
    Returns the indices of the steps that drafted."""
    drafted = []
    for i in range(steps):
        draft = policy.want_draft(WIDTH)
        seconds, tokens = cost(i, draft)
        policy.record(WIDTH, draft, seconds, tokens)
        if draft:
            drafted.append(i)
    return drafted


def doubling_waits() -> list[int]:
    """The waits between probes after the first, doubling from REPROBE_EVERY's double."""
    return [min(REPROBE_EVERY << k, MAX_REPROBE_EVERY) for k in range(1, 12)]


def probes(start: int, waits: list[int]) -> list[int]:
    """Steps of probes of PROBE_STEPS steps: the first at `start`, each next one `wait` later."""
    out, at = [], start
    for wait in waits:
        out += range(at, at + PROBE_STEPS)
        at += wait
    return out


def test_a_losing_head_that_keeps_drafts_is_probed_less_and_less_often() -> None:
    # Rounds keep one draft in four rows (5 tokens) but cost 3 s: 0.6 s a token against 0.25.
    cost = lambda i, draft: (3.0, WIDTH + 1) if draft else (1.0, WIDTH)  # noqa: E731
    drafted = drafting_steps(WidthDrafting(), 400, cost)
    first = FIRST_ROUNDS + PROBE_STEPS + REPROBE_EVERY  # counted from the first judged step
    waits = doubling_waits()
    assert drafted == list(range(FIRST_ROUNDS)) + [s for s in probes(first, waits) if s < 400]


def test_a_head_that_keeps_nothing_waits_longer() -> None:
    cost = lambda i, draft: (1.5, WIDTH) if draft else (1.0, WIDTH)  # noqa: E731
    drafted = drafting_steps(WidthDrafting(), 600, cost)
    first = FIRST_ROUNDS + PROBE_STEPS + USELESS_EVERY
    assert drafted == list(range(FIRST_ROUNDS)) + probes(first, [2 * USELESS_EVERY])
    assert len(drafted) == FIRST_ROUNDS + PROBE_STEPS  # 8 of 600 steps draft


def test_a_winning_head_drafts_and_probes_plain_steps_rarely() -> None:
    cost = lambda i, draft: (1.2, 2 * WIDTH) if draft else (1.0, WIDTH)  # noqa: E731
    drafted = drafting_steps(WidthDrafting(), 300, cost)
    plain = sorted(set(range(300)) - set(drafted))
    first = FIRST_ROUNDS + PROBE_STEPS + REPROBE_EVERY
    waits = doubling_waits()
    expected = [s for s in probes(first, waits) if s < 300]
    assert plain == list(range(FIRST_ROUNDS, FIRST_ROUNDS + PROBE_STEPS)) + expected


def test_a_change_of_choice_brings_the_next_probe_back_soon() -> None:
    """Rounds win, then (the text turns unpredictable) lose: once the medians say so, the
    width decodes plainly, and its first probe comes REPROBE_EVERY steps later, not after the
    long wait the winning choice had reached."""
    turn = 150

    def cost(i: int, draft: bool) -> tuple[float, int]:
        if not draft:
            return 1.0, WIDTH
        return (1.2, 2 * WIDTH) if i < turn else (3.0, WIDTH + 1)

    policy = WidthDrafting()
    drafted = drafting_steps(policy, 400, cost)
    assert policy.widths[WIDTH].choice is False
    # Drafting ends soon after the turn (the median of the kept rounds changes), and every
    # step after that drafts only in probes of PROBE_STEPS steps.
    after = [s for s in drafted if s >= turn]
    switched = next(s for s in range(turn, 400) if s not in drafted)
    assert switched < turn + 16
    late = [s for s in after if s > switched]
    assert late and len(late) % PROBE_STEPS == 0
    assert late[0] - switched == REPROBE_EVERY


def test_stalls_in_a_widths_first_rounds_do_not_send_it_to_plain_steps() -> None:
    """Two of a width's first rounds stall (a first-use kernel build, another tenant's burst):
    30 s against their steady 1.2 s for 2 tokens a row. Per token the rounds still win (0.15 s
    against plain's 0.25 s), so after its plain probe the width drafts, as it does without
    the stalls (plain only in its probes); a median of the four rounds (15.6 s) would have
    chosen plain steps."""

    def cost(i: int, draft: bool) -> tuple[float, int]:
        if not draft:
            return 1.0, WIDTH
        return (30.0 if i in (0, 2) else 1.2), 2 * WIDTH

    policy = WidthDrafting()
    drafted = drafting_steps(policy, 40, cost)
    assert policy.widths[WIDTH].choice is True
    judged = FIRST_ROUNDS + PROBE_STEPS
    plain_probes = probes(judged + REPROBE_EVERY, doubling_waits())
    assert drafted == list(range(FIRST_ROUNDS)) + [
        s for s in range(judged, 40) if s not in plain_probes
    ]


def test_a_rounds_cost_is_spread_over_its_mean_yield() -> None:
    """Rounds keep every row's draft and none in turn (1.5 tokens a row on average) at 1.4 s
    a round: 0.233 s a token against plain's 0.25, so the width drafts. (Each round's own
    seconds per token, 0.175 and 0.35, have a median of 0.26: a loss.) Slower rounds, 1.6 s
    (0.267 s a token), lose."""

    def costs(seconds: float):
        return lambda i, draft: (seconds, (2 if i % 2 else 1) * WIDTH) if draft else (1.0, WIDTH)

    winning = WidthDrafting()
    drafting_steps(winning, 40, costs(1.4))
    assert winning.widths[WIDTH].choice is True
    losing = WidthDrafting()
    drafting_steps(losing, 40, costs(1.6))
    assert losing.widths[WIDTH].choice is False


def test_the_heads_catch_up_runs_in_chunks_of_powers_of_two() -> None:
    """A batch's head catches up on a plain stretch's pairs in chunks whose lengths are the
    powers of two that sum to the count, so a server meets few shapes (`head.power_chunks`)."""
    from mtpkit.speculative.proposers.mtp_head import power_chunks

    assert power_chunks(1) == [(0, 1)]
    assert power_chunks(37) == [(0, 32), (32, 36), (36, 37)]
    for n in range(1, 300):
        spans = power_chunks(n)
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans[:-1], spans[1:], strict=True))
        lengths = [j - i for i, j in spans]
        assert all(x & (x - 1) == 0 for x in lengths) and lengths == sorted(lengths, reverse=True)


def test_a_width_met_later_starts_from_the_nearest_judged_widths_choice() -> None:
    """Rows leave a batch one by one: width 3, met after width 4 was judged, takes width 4's
    choice at once (no first rounds and plain probe of its own) for as many steps as width 4
    waits between probes, then explores on its own."""
    cost = lambda i, draft: (1.2, 2 * WIDTH) if draft else (1.0, WIDTH)  # noqa: E731
    policy = WidthDrafting()
    drafting_steps(policy, FIRST_ROUNDS + PROBE_STEPS + 1, cost)  # width 4 judged: drafting
    assert policy.widths[WIDTH].choice is True
    narrower = []
    for _ in range(REPROBE_EVERY + FIRST_ROUNDS + PROBE_STEPS + 1):
        draft = policy.want_draft(3)
        policy.record(3, draft, 0.9 if draft else 0.75, 6 if draft else 3)
        narrower.append(draft)
    # Borrowed drafting for REPROBE_EVERY steps: its own FIRST_ROUNDS rounds came in them, so
    # its own exploration is the plain probe, then its own choice (drafting) holds.
    assert narrower[:REPROBE_EVERY] == [True] * REPROBE_EVERY
    assert narrower[REPROBE_EVERY : REPROBE_EVERY + PROBE_STEPS] == [False] * PROBE_STEPS
    assert narrower[REPROBE_EVERY + PROBE_STEPS :] == [True] * (FIRST_ROUNDS + 1)
    assert policy.widths[3].choice is True
    # A useless head: width 4 chose plain steps and waits USELESS_EVERY between probes, so
    # width 1 takes plain steps that long without drafting a round.
    useless = WidthDrafting()
    drafting_steps(useless, FIRST_ROUNDS + PROBE_STEPS + 1, lambda i, d: (1.5 if d else 1.0, WIDTH))
    assert useless.widths[WIDTH].choice is False
    assert not any(useless.want_draft(1) for _ in range(USELESS_EVERY))
