"""The `mtp` command: one entry point, one module per subcommand.

Each subcommand module exposes `HELP` (one line), `add_arguments(parser)` and
`run(args) -> int`. Modules are imported only to build their parser; heavy
imports (torch, kopf) happen inside `run`, so `mtp --help` stays fast.
Subcommands that need the operator package (`up`, `operator`) are contributed
through the `mtp.commands` entry-point group, so this package never imports
Kubernetes code itself. Every long flag takes both spellings, `--flag_name`
and `--flag-name`, and a flag a subcommand does not know is reported with
that subcommand's usage.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib import metadata
from typing import Sequence

from mtp_runtime.flag_spellings import add_alternate_spellings

# name -> module path, in the order `mtp --help` lists them.
BUILTIN_COMMANDS: dict[str, str] = {
    "make-tiny": "mtp_runtime.commands.make_tiny",
    "export": "mtp_runtime.commands.export",
    "generate": "mtp_runtime.commands.generate",
    "serve": "mtp_runtime.commands.serve",
    "bench": "mtp_runtime.commands.bench",
}

ENTRY_POINT_GROUP = "mtp.commands"

DESCRIPTION = """\
mtp: serve DeepSeek-V3/R1/V3.2 and GLM-4.5 MoE models with MTP speculative
decoding, on one machine or across many (Kubernetes operator included).

Typical flow:
  mtp make-tiny --arch deepseek_v3 --out /tmp/tiny        # small test checkpoint
  mtp export --input-dir /tmp/tiny --output-dir /tmp/tiny-mtp   # cut out the MTP draft
"""


def _command_modules() -> dict[str, str]:
    commands = dict(BUILTIN_COMMANDS)
    try:
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # pragma: no cover - broken metadata should not kill the CLI
        eps = []
    for ep in eps:
        commands.setdefault(ep.name, ep.value.split(":")[0])
    return commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtp",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_path in _command_modules().items():
        module = importlib.import_module(module_path)
        sp = sub.add_parser(
            name,
            help=module.HELP,
            description=getattr(module, "DESCRIPTION", module.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sp)
        add_alternate_spellings(sp)
        sp.set_defaults(_module=module, _parser=sp)
    return parser


def _version() -> str:
    try:
        return f"mtp {metadata.version('mtp-operator')}"
    except metadata.PackageNotFoundError:
        from mtp_runtime import __version__

        return f"mtp {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # name the subcommand whose flags these are not (argparse would blame `mtp`)
        (getattr(args, "_parser", None) or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
