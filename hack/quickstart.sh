#!/usr/bin/env bash
# Quick start on the embedded default, no cluster: sets up .venv, then runs the
# tiny CPU MtpDeployment sample with `mtp up` — the operator's own plan,
# realised as local processes. The first run builds a small DeepSeek-V3-layout
# model trained jointly with its MTP layer (a few minutes on 2 cores, cached),
# exports the draft, starts the rank(s), waits for Ready, sends completions to
# rank 0 and prints the status the operator would write, acceptance included.
# Extra arguments go to `mtp up` (e.g. drop --once by running `mtp up FILE`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash hack/setup-env.sh
# shellcheck disable=SC1091
. "${MTP_VENV:-.venv}/bin/activate"
exec mtp up crds/samples/tiny-cpu.yaml --once --requests 3 "$@"
