#!/usr/bin/env bash
# Quick start on the embedded default: sets up .venv, builds a tiny checkpoint
# in the real DeepSeek-V3 layout and exports its MTP draft model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash hack/setup-env.sh
# shellcheck disable=SC1091
. "${MTP_VENV:-.venv}/bin/activate"
OUT="${MTP_QUICKSTART_DIR:-out/quickstart}"
mtp make-tiny --arch deepseek_v3 --out "$OUT/tiny-deepseek-v3"
mtp export --input-dir "$OUT/tiny-deepseek-v3" --output-dir "$OUT/tiny-deepseek-v3-mtp"
ls -l "$OUT/tiny-deepseek-v3-mtp"
