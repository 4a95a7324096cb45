#!/usr/bin/env bash
# The test command (README and CI run exactly this): sets up .venv with what
# the tests need, then runs the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash hack/setup-env.sh
# shellcheck disable=SC1091
. "${MTP_VENV:-.venv}/bin/activate"
exec python -m pytest "$@"
