#!/usr/bin/env python3
"""Regenerate the MtpDeployment CRD YAML from the operator's pydantic models.

    python hack/gen_crds.py          # writes crds/ (and the chart's copy if the chart exists)
    python hack/gen_crds.py --check  # exit 1 if a committed copy differs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))

from mtp_operator.crd import crd_paths, render_crd, write_crds  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args()
    if args.check:
        expected = render_crd()
        stale = [p for p in crd_paths(REPO) if not p.exists() or p.read_text() != expected]
        for path in stale:
            print(f"out of date: {path.relative_to(REPO)} (run python hack/gen_crds.py)", file=sys.stderr)
        return 1 if stale else 0
    for path in write_crds(REPO):
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
