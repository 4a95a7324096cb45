"""Every `mtp` subcommand takes `--flag_name` and `--flag-name`; an unknown flag names its subcommand."""

import argparse

import pytest

from mtp_runtime import cli
from mtp_runtime.flag_spellings import alternate_spelling
from mtp_runtime.server.args import ServeArgsError, parse_serve_argv


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_alternate_spelling():
    assert alternate_spelling("--num_speculative_tokens") == "--num-speculative-tokens"
    assert alternate_spelling("--input-dir") == "--input_dir"
    assert alternate_spelling("--port") is None and alternate_spelling("-h") is None


def test_every_long_flag_of_every_subcommand_parses_in_both_spellings():
    checked = 0
    for name, parser in subcommand_parsers().items():
        for action in parser._actions:
            for option in action.option_strings:
                other = alternate_spelling(option)
                if other is None:
                    continue
                assert parser._option_string_actions.get(other) is action, f"mtp {name} {other}"
                checked += 1
    assert checked > 40  # serve, export, make-tiny, bench, up, ... all have such flags


def test_both_spellings_give_the_same_arguments(tmp_path):
    parser = cli.build_parser()
    dashes = parser.parse_args(["export", "--input-dir", "a", "--output-dir", "b", "--model-type", "glm4_moe"])
    underscores = parser.parse_args(["export", "--input_dir", "a", "--output_dir=b", "--model_type", "glm4_moe"])
    assert vars(dashes) == vars(underscores)
    serve = parser.parse_args(["serve", "--model", "m", "--num-speculative-tokens=2", "--max-model-len", "64"])
    assert serve.num_speculative_tokens == 2 and serve.max_model_len == 64
    # The operator checks a spec's runtime flags with the server's own parser: the same spellings.
    assert parse_serve_argv(["--model", "m", "--draft-model", "d"]).draft_model == "d"


def test_help_lists_each_flag_once(capsys):
    with pytest.raises(SystemExit):
        cli.main(["export", "--help"])
    out = capsys.readouterr().out
    assert "--input-dir" in out and "--input_dir" not in out


@pytest.mark.parametrize("argv, command", [
    (["serve", "--model", "m", "--no-such-flag", "1"], "serve"),
    (["export", "--input-dir", "a", "--output-dir", "b", "--bogus"], "export"),
    (["make-tiny", "--arch", "deepseek_v3", "--out", "x", "--hidden"], "make-tiny"),  # no abbreviations
    (["up", "file.yaml", "--onc"], "up"),
])
def test_an_unknown_flag_names_its_subcommand(argv, command, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: mtp {command} ") and f"mtp {command}: error: unrecognized arguments:" in err


def test_serve_parser_refuses_abbreviations():
    with pytest.raises(ServeArgsError):
        parse_serve_argv(["--model", "m", "--draft", "d"])
