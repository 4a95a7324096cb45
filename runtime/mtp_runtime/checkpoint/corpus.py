"""An offline text corpus: the Python standard library's own .py sources.

Files are listed in a fixed order and split into train / held-out by a hash of
their relative path, so the split is the same on every run and machine with
the same Python, and held-out files never leak into tokenizer or model training.
"""

from __future__ import annotations

import functools
import hashlib
import os
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
    files = [path for path, heldout in _listing(str(stdlib_dir())) if heldout == (split == "heldout")]
    if not files:
        raise FileNotFoundError(
            f"no .py sources under {stdlib_dir()} for split {split!r}: is the standard library installed?"
        )
    return files


@functools.lru_cache(maxsize=4)
def _listing(root: str) -> tuple[tuple[Path, bool], ...]:
    """(file, is held-out) for every stdlib source, sorted by relative path."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]  # prune, don't descend
        for fname in filenames:
            if fname.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, fname), root).replace(os.sep, "/")
                found.append(rel)
    listing = []
    for rel in sorted(found):
        bucket = int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HELDOUT_MODULUS
        listing.append((Path(root) / rel, bucket == 0))
    return tuple(listing)


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
