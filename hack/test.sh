#!/usr/bin/env bash
# The test command (README and CI run exactly this): sets up .venv with what
# the tests need, then runs the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash hack/setup-env.sh
# shellcheck disable=SC1091
. "${MTP_VENV:-.venv}/bin/activate"
# The real control plane of tests/cluster: built once per version and cached (see the README).
MTP_CONTROL_PLANE_BIN="$(bash hack/control-plane-bin.sh)"
export MTP_CONTROL_PLANE_BIN
exec python -m pytest "$@"
