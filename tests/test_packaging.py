"""The package layout: import names, the stdlib `operator`, the CLI."""

import importlib
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_stdlib_operator_is_not_shadowed():
    # Run from the repository root, where a folder named `operator/` sits:
    # the stdlib module must still be the one imported.
    code = (
        "import operator, sys, sysconfig;"
        "print(operator.__file__);"
        "print(operator.itemgetter(1)([0, 7]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(out[0]).resolve().parent == stdlib
    assert out[1] == "7"
    assert not (REPO / "operator" / "__init__.py").exists()


def test_import_names():
    op = importlib.import_module("mtp_operator")
    rt = importlib.import_module("mtp_runtime")
    assert Path(op.__file__).resolve().is_relative_to(REPO / "operator")
    assert Path(rt.__file__).resolve().is_relative_to(REPO / "runtime")


def test_runtime_has_no_kubernetes_imports():
    offenders = []
    for path in (REPO / "runtime").rglob("*.py"):
        text = path.read_text()
        for bad in ("import kopf", "from kopf", "import kubernetes", "from kubernetes", "mtp_operator"):
            if bad in text:
                offenders.append(f"{path.relative_to(REPO)}: {bad}")
    assert not offenders, offenders


def test_cli_help_lists_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "mtp_runtime", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in ("make-tiny", "export"):
        assert name in out
