"""`mtp-export.json`: written last into an export, so its presence means the export finished.

It records where the draft came from (a fingerprint of the source config and
index plus the export options), the tool version and the sha256 and size of
every file, so a re-run can tell an up-to-date export from a stale one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .. import __version__

MANIFEST_FILE = "mtp-export.json"
FORMAT_VERSION = 1


def source_fingerprint(config_path: Path, index_path: Path, options: dict) -> str:
    """sha256 over the source config.json, its index (or single shard's header) and the options."""
    h = hashlib.sha256()
    h.update(Path(config_path).read_bytes())
    index_path = Path(index_path)
    if index_path.name.endswith(".json"):
        h.update(index_path.read_bytes())
    else:  # a single model.safetensors: its header describes every tensor, and its size the data
        with open(index_path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h.update(f.read(n))
        h.update(str(index_path.stat().st_size).encode())
    h.update(json.dumps(options, sort_keys=True).encode())
    return h.hexdigest()


def build_manifest(input_dir: Path, fingerprint: str, options: dict, files: dict[str, dict]) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "tool": "mtp export",
        "tool_version": __version__,
        "source": {"input_dir": str(Path(input_dir).resolve()), "fingerprint": fingerprint},
        "options": options,
        "files": dict(sorted(files.items())),
    }


def read_manifest(output_dir: Path) -> dict | None:
    """The manifest of an earlier export, or None if there is none or it is unreadable."""
    try:
        data = json.loads((Path(output_dir) / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_up_to_date(output_dir: Path, manifest: dict, fingerprint: str) -> bool:
    """Same source and options, and every listed file present at its recorded size (no re-hashing)."""
    if manifest.get("source", {}).get("fingerprint") != fingerprint:
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for name, entry in files.items():
        path = Path(output_dir) / name
        if not path.is_file() or path.stat().st_size != entry.get("size"):
            return False
    return True
