"""Building a missing sample model with `mtp make-tiny` before `mtp up` runs it.

A sample MtpDeployment can carry the annotation MAKE_TINY_ANNOTATION whose
value is the make-tiny arguments (without --out). Annotations are free-form,
so the resource stays valid for the API server; the operator ignores it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

from mtp_operator.constants import GROUP

MAKE_TINY_ANNOTATION = f"{GROUP}/make-tiny"


class ModelPrepError(RuntimeError):
    """The model is missing and cannot be made; the message says why and what to do."""


def model_is_present(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file()


def make_tiny_argv(annotation: str, out_dir: Path) -> list[str]:
    try:
        args = shlex.split(annotation)
    except ValueError as exc:
        raise ModelPrepError(f"annotation {MAKE_TINY_ANNOTATION}: {exc}") from None
    if any(a == "--out" or a.startswith("--out=") for a in args):
        raise ModelPrepError(f"annotation {MAKE_TINY_ANNOTATION}: leave out --out; the model path is spec.model.path")
    return [sys.executable, "-m", "mtp_runtime", "make-tiny", *args, "--out", str(out_dir)]


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
    """Make the model at `model_dir` if it is missing; True when it was made.

    make-tiny (its training progress included) streams to `output`. It writes
    into a scratch folder beside the target that is renamed into place only
    when it succeeded, so a failed or interrupted run leaves nothing behind.
    """
    if model_is_present(model_dir):
        return False
    if model_dir.exists() and any(model_dir.iterdir()):
        raise ModelPrepError(f"spec.model.path: {model_dir} exists but has no config.json; it is not a model")
    annotation = annotations.get(MAKE_TINY_ANNOTATION)
    if annotation is None:
        raise ModelPrepError(
            f"spec.model.path: no model at {model_dir} (no config.json). Put the checkpoint there, or add the "
            f"annotation {MAKE_TINY_ANNOTATION}: '--arch deepseek_v3' to have `mtp up` build a tiny one"
        )
    scratch = model_dir.with_name(f".{model_dir.name}.making-{os.getpid()}")
    argv = make_tiny_argv(annotation, scratch)
    log(f"making the model: mtp make-tiny {' '.join(shlex.quote(a) for a in argv[4:-2])} --out {model_dir}")
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        code, tail = run_streaming(argv, output)
        if code != 0:
            raise ModelPrepError(
                f"mtp make-tiny failed (exit {code}) for annotation {MAKE_TINY_ANNOTATION}:\n{tail.strip()[-2000:]}"
            )
        if model_dir.exists():
            model_dir.rmdir()  # empty, checked above
        os.rename(scratch, model_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return True
