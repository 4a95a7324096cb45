"""An offline text corpus: the Python standard library's own .py sources.

Files are listed in a fixed order and split into train / held-out by a hash of
their relative path, so the split is the same on every run and machine with
the same Python, and held-out files never leak into tokenizer or model training.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

SPLITS = ("train", "heldout")
# One file in HELDOUT_MODULUS goes to the held-out split.
HELDOUT_MODULUS = 10
# Third-party code and the huge generated test data are not "the standard library".
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3"}

DEFAULT_MAX_BYTES = 4 * 1024 * 1024


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(split: str) -> list[Path]:
    """Sorted stdlib .py files of one split."""
    if split not in SPLITS:
        raise ValueError(f"corpus split must be one of {SPLITS}, got {split!r}")
    root = stdlib_dir()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]):
            continue
        bucket = int(hashlib.sha1(rel.as_posix().encode()).hexdigest(), 16) % HELDOUT_MODULUS
        if (bucket == 0) == (split == "heldout"):
            files.append(path)
    if not files:
        raise FileNotFoundError(f"no .py sources under {root} for split {split!r}: is the standard library installed?")
    return files


def corpus_texts(split: str, max_bytes: int = DEFAULT_MAX_BYTES) -> list[str]:
    """Texts of the split's files in order, stopping before `max_bytes` of UTF-8 in total."""
    texts, total = [], 0
    for path in corpus_files(split):
        text = path.read_text(encoding="utf-8", errors="replace")
        size = len(text.encode("utf-8"))
        if total + size > max_bytes:
            if total:
                break
            text = text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
            size = max_bytes
        texts.append(text)
        total += size
    return texts
