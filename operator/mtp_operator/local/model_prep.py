"""Building a missing sample model with `mtp make-tiny` before `mtp up` runs it.

A sample MtpDeployment can carry the annotation MAKE_TINY_ANNOTATION whose
value is the make-tiny arguments (without --out). Annotations are free-form,
so the resource stays valid for the API server; the operator ignores it.

A model made here records those arguments in MADE_WITH_FILE, so a later run
whose annotation asks for another model rebuilds it (the old one stays until
the new one is in place) instead of silently serving the old one. A model
without that record was put there by someone else and is used as it is.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

from mtp_operator.constants import GROUP

MAKE_TINY_ANNOTATION = f"{GROUP}/make-tiny"
# Inside a model `mtp up` made: the make-tiny arguments it was made with.
MADE_WITH_FILE = ".mtp-up-make-tiny.json"


class ModelPrepError(RuntimeError):
    """The model is missing and cannot be made; the message says why and what to do."""


def model_is_present(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file()


def annotation_args(annotation: str) -> list[str]:
    try:
        args = shlex.split(annotation)
    except ValueError as exc:
        raise ModelPrepError(f"annotation {MAKE_TINY_ANNOTATION}: {exc}") from None
    if any(a == "--out" or a.startswith("--out=") for a in args):
        raise ModelPrepError(f"annotation {MAKE_TINY_ANNOTATION}: leave out --out; the model path is spec.model.path")
    return args


def make_tiny_argv(annotation: str, out_dir: Path) -> list[str]:
    return [sys.executable, "-m", "mtp_runtime", "make-tiny", *annotation_args(annotation), "--out", str(out_dir)]


def made_with(model_dir: Path) -> list[str] | None:
    """The make-tiny arguments `mtp up` made this model with; None if it did not make it."""
    try:
        record = json.loads((model_dir / MADE_WITH_FILE).read_text())
    except (OSError, ValueError):
        return None
    args = record.get("args") if isinstance(record, dict) else None
    return args if isinstance(args, list) and all(isinstance(a, str) for a in args) else None


def run_streaming(argv: list[str], output: Callable[[str], None], keep: int = 20) -> tuple[int, str]:
    """Run argv, passing each output line on as it comes; (exit code, last lines)."""
    tail: list[str] = []
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          text=True, errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            output(line.rstrip("\n"))
            tail = (tail + [line.rstrip("\n")])[-keep:]
    return proc.returncode, "\n".join(tail)


def ensure_model(
    model_dir: Path,
    annotations: dict[str, str],
    log: Callable[[str], None] = print,
    output: Callable[[str], None] = lambda line: print(f"  {line}", file=sys.stderr, flush=True),
) -> bool:
    """Make the model at `model_dir` if it is missing, or remake one `mtp up` made with other
    make-tiny arguments than the annotation now gives; True when it was (re)made.

    make-tiny (its training progress included) streams to `output`. It writes
    into a scratch folder beside the target that is renamed into place only
    when it succeeded, so a failed or interrupted run leaves nothing behind
    (and an old model stays as it was).
    """
    annotation = annotations.get(MAKE_TINY_ANNOTATION)
    if model_is_present(model_dir):
        if annotation is None:
            return False
        wanted, recorded = annotation_args(annotation), made_with(model_dir)
        if recorded is None:
            log(f"spec.model.path: using the model at {model_dir} as it is: mtp up did not make it, so the "
                f"{MAKE_TINY_ANNOTATION} annotation (only for a missing model) does not apply")
            return False
        if recorded == wanted:
            return False
        log(f"spec.model.path: the model at {model_dir} was made with make-tiny {shlex.join(recorded)}; the "
            f"{MAKE_TINY_ANNOTATION} annotation now says {shlex.join(wanted)}: remaking it")
        _make(model_dir, annotation, log, output)
        return True
    if model_dir.exists() and any(model_dir.iterdir()):
        raise ModelPrepError(f"spec.model.path: {model_dir} exists but has no config.json; it is not a model")
    if annotation is None:
        raise ModelPrepError(
            f"spec.model.path: no model at {model_dir} (no config.json). Put the checkpoint there, or add the "
            f"annotation {MAKE_TINY_ANNOTATION}: '--arch deepseek_v3' to have `mtp up` build a tiny one"
        )
    _make(model_dir, annotation, log, output)
    return True


def _make(model_dir: Path, annotation: str, log: Callable[[str], None], output: Callable[[str], None]) -> None:
    scratch = model_dir.with_name(f".{model_dir.name}.making-{os.getpid()}")
    old = model_dir.with_name(f".{model_dir.name}.old-{os.getpid()}")
    argv = make_tiny_argv(annotation, scratch)
    log(f"making the model: mtp make-tiny {shlex.join(argv[4:-2])} --out {model_dir}")
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        code, tail = run_streaming(argv, output)
        if code != 0:
            raise ModelPrepError(
                f"mtp make-tiny failed (exit {code}) for annotation {MAKE_TINY_ANNOTATION}:\n{tail.strip()[-2000:]}"
            )
        (scratch / MADE_WITH_FILE).write_text(json.dumps({"args": argv[4:-2]}) + "\n")
        replacing = model_is_present(model_dir)  # a model mtp up made before: moved aside only now
        if replacing:
            os.rename(model_dir, old)
        elif model_dir.exists():
            model_dir.rmdir()  # empty, checked by the caller
        try:
            os.rename(scratch, model_dir)
        except OSError:
            if replacing:
                os.rename(old, model_dir)
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
