"""Numbers and fixed choices on the command line: usage errors (exit 2) in Click's wording,
`nan` and `inf` named as such, before anything is loaded (`mtpkit.cli.values`)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from mtpkit.cli.app import app

runner = CliRunner()
SEED_RANGE = "0<=x<=18446744073709551615"


@pytest.mark.parametrize(
    ("args", "error"),
    [
        # issue 32, 5: a seed MLX cannot take fails before loading, not after.
        (["generate", "--seed", "-1"], f"'--seed': -1 is not in the range {SEED_RANGE}."),
        (
            ["generate", "--seed", "99999999999999999999"],
            f"'--seed': 99999999999999999999 is not in the range {SEED_RANGE}.",
        ),
        (
            ["train-head", "M", "-o", "o", "--seed", "-1"],
            f"'--seed': -1 is not in the range {SEED_RANGE}.",
        ),
        # issue 33, 18: not a number is not a range error.
        (["generate", "--temp", "nan"], "'--temp': 'nan' is not a number."),
        (["generate", "--timeout", "nan"], "'--timeout': 'nan' is not a number."),
        (["train-head", "M", "-o", "o", "--lr", "nan"], "'--lr': 'nan' is not a number."),
        # issue 33, 6: an infinite learning rate is refused.
        (["train-head", "M", "-o", "o", "--lr", "inf"], "'--lr': 'inf' is not a finite number."),
        (["generate", "--temp", "-inf"], "'--temp': '-inf' is not a finite number."),
        # issue 32, 17: Click's sentences, not pydantic's.
        (["generate", "--temp", "-1"], "'--temp': -1.0 is not in the range x>=0.0."),
        (["generate", "--top-p", "5"], "'--top-p': 5.0 is not in the range 0.0<=x<=1.0."),
        (["generate", "-m", "x"], "'--max-tokens' / '-m': 'x' is not a valid integer."),
        (["generate", "--temp", "warm"], "'--temp': 'warm' is not a valid float."),
        (
            ["check", "D", "--min-acceptance", "2"],
            "'--min-acceptance': 2.0 is not in the range 0.0<=x<=1.0.",
        ),
        (["bench", "--trials", "0"], "'--trials': 0 is not in the range x>=1."),
        (
            ["convert", "D", "-o", "o", "--q-bits", "7"],
            "'--q-bits' / '--bits': '7' is not one of '2', '3', '4', '5', '6', '8'.",
        ),
        (
            ["generate", "--hidden", "mid"],
            "'--hidden': 'mid' is not one of 'post_norm', 'pre_norm'.",
        ),
    ],
)
def test_a_bad_number_or_choice_is_a_usage_error_in_clicks_words(args, error):
    if args[0] == "generate":
        args = [*args, "--model", "M"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert lines[0] == f"Usage: mtpkit {args[0]} [OPTIONS]" + {
        "train-head": " [MODEL]",
        "check": " [SOURCE]",
        "convert": " [SOURCE]",
    }.get(args[0], "")
    assert lines[-1] == f"Error: Invalid value for {error}"
    assert "Input should" not in result.stderr and "Value error" not in result.stderr


def test_train_heads_usage_and_errors_say_model():
    """The usage line says MODEL; so do the errors about it (issue 32, 17)."""
    missing = runner.invoke(app, ["train-head", "-o", "out"])
    assert missing.exit_code == 2
    assert missing.stderr.splitlines()[0] == "Usage: mtpkit train-head [OPTIONS] [MODEL]"
    assert missing.stderr.splitlines()[-1] == "Error: Missing argument 'MODEL' (or --model MODEL)."
    twice = runner.invoke(app, ["train-head", "a", "--model", "b", "-o", "out"])
    assert (
        twice.stderr.splitlines()[-1] == "Error: got MODEL 'a' and --model 'b': name the model once"
    )
    assert "--model MODEL" in runner.invoke(app, ["train-head", "-h"]).stdout


def test_ranges_still_show_in_help():
    text = " ".join(runner.invoke(app, ["generate", "-h"]).stdout.split())
    assert "[default: 0.0; x>=0.0]" in text
    assert f"[{SEED_RANGE}]" in text
