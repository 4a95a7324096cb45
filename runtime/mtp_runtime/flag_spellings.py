"""Both spellings of every long flag: `--flag_name` (xLLM's) and `--flag-name` (vLLM's).

The other spelling is registered for parsing only, so `--help` lists each
flag once, as it was declared.
"""

from __future__ import annotations

import argparse


def alternate_spelling(option: str) -> str | None:
    """`--max_model_len` <-> `--max-model-len`; None for a flag with neither in its name."""
    if not option.startswith("--"):
        return None
    name = option[2:]
    if "_" in name:
        return "--" + name.replace("_", "-")
    if "-" in name:
        return "--" + name.replace("-", "_")
    return None


def add_alternate_spellings(parser: argparse.ArgumentParser) -> None:
    """Let every long option of `parser` also be given in the other spelling.

    Abbreviations are switched off: with two spellings a prefix would match
    both, and a typo like `--draft` silently meaning `--draft_model` is a trap
    anyway. A spelling the parser already uses for another flag is left alone.
    """
    parser.allow_abbrev = False
    for action in list(parser._actions):
        for option in list(action.option_strings):
            other = alternate_spelling(option)
            if other is not None and other not in parser._option_string_actions:
                parser._option_string_actions[other] = action
