#!/usr/bin/env bash
# Provides the pinned upstream control-plane binaries of the real-API test tier
# (tests/cluster) and prints the directory that holds them:
#
#     kube-apiserver, kube-controller-manager   k8s.io/kubernetes $K8S_VERSION, built from the
#                                               Go module (hack/control-plane/go.mod pins it)
#     kwok                                      sigs.k8s.io/kwok $KWOK_VERSION (fake nodes and pods)
#     etcd                                      go.etcd.io/etcd $ETCD_VERSION (hack/control-plane/etcd/go.mod)
#
#     bash hack/control-plane-bin.sh            # build what is missing, print the directory
#     MTP_CONTROL_PLANE_BIN=DIR ...             # use DIR's four binaries instead (nothing is built)
#     KUBEBUILDER_ASSETS=DIR ...                # envtest's assets: its etcd and kube-apiserver
#                                               # are used, the other two are built as usual
#
# Built binaries are cached by version under ${XDG_CACHE_HOME:-~/.cache}/mtp-operator/;
# a cold build takes about 10 minutes on 2 cores, a cached one nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

K8S_VERSION=v1.34.4
KWOK_VERSION=v0.7.0
ETCD_VERSION=v3.6.5  # must match hack/control-plane/etcd/go.mod
NAMES=(kube-apiserver kube-controller-manager kwok etcd)

log() { echo "control-plane-bin: $*" >&2; }

if [ -n "${MTP_CONTROL_PLANE_BIN:-}" ]; then
    for name in "${NAMES[@]}"; do
        if [ ! -x "$MTP_CONTROL_PLANE_BIN/$name" ]; then
            log "MTP_CONTROL_PLANE_BIN=$MTP_CONTROL_PLANE_BIN has no executable $name"
            exit 1
        fi
    done
    echo "$MTP_CONTROL_PLANE_BIN"
    exit 0
fi

cache="${XDG_CACHE_HOME:-$HOME/.cache}/mtp-operator/control-plane/k8s-$K8S_VERSION-kwok-$KWOK_VERSION-etcd-$ETCD_VERSION"
mkdir -p "$cache"

need_go() {
    if ! command -v go >/dev/null; then
        log "building $1 needs Go (1.24 or newer) on PATH; or set MTP_CONTROL_PLANE_BIN to a directory with ${NAMES[*]}"
        exit 1
    fi
}

# Each build goes to a temporary directory and is renamed into place, so an
# interrupted build never leaves a binary that looks finished.
build_kube() {
    local want=()
    for name in "$@"; do
        [ -x "$cache/$name" ] || want+=("$name")
    done
    [ ${#want[@]} -gt 0 ] || return 0
    need_go "${want[*]}"
    log "building ${want[*]} $K8S_VERSION into $cache (once per version; about 10 minutes on 2 cores)"
    local tmp pkgs=() start=$SECONDS
    tmp="$(mktemp -d "$cache/.build.XXXXXX")"
    for name in "${want[@]}"; do pkgs+=("k8s.io/kubernetes/cmd/$name"); done
    local minor="${K8S_VERSION#v1.}"
    minor="${minor%%.*}"
    (cd hack/control-plane && GOFLAGS=-mod=mod go build -trimpath -o "$tmp/" \
        -ldflags "-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION \
                  -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor" \
        "${pkgs[@]}")
    for name in "${want[@]}"; do mv "$tmp/$name" "$cache/$name"; done
    rmdir "$tmp"
    log "built ${want[*]} in $((SECONDS - start)) s"
}

# build_one NAME VERSION COMMAND...: run COMMAND (which writes $tmp/NAME) unless NAME is cached.
build_one() {
    local name=$1 version=$2
    shift 2
    [ -x "$cache/$name" ] && return 0
    need_go "$name"
    log "building $name $version into $cache"
    local start=$SECONDS
    tmp="$(mktemp -d "$cache/.build.XXXXXX")"
    "$@"
    mv "$tmp/$name" "$cache/$name"
    rmdir "$tmp"
    log "built $name in $((SECONDS - start)) s"
}

go_install_kwok() {
    GOBIN="$tmp" GOFLAGS='' go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
}

go_build_etcd() {
    (cd hack/control-plane/etcd && GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w" -o "$tmp/etcd" \
        go.etcd.io/etcd/server/v3)
}

assets_apiserver=""
if [ -n "${KUBEBUILDER_ASSETS:-}" ] && [ -x "$KUBEBUILDER_ASSETS/kube-apiserver" ]; then
    assets_apiserver="$KUBEBUILDER_ASSETS/kube-apiserver"
fi
if [ -n "$assets_apiserver" ]; then
    build_kube kube-controller-manager
else
    build_kube kube-apiserver kube-controller-manager
fi
build_one kwok "$KWOK_VERSION" go_install_kwok
assets_etcd=""
if [ -n "${KUBEBUILDER_ASSETS:-}" ] && [ -x "$KUBEBUILDER_ASSETS/etcd" ]; then
    assets_etcd="$KUBEBUILDER_ASSETS/etcd"
else
    build_one etcd "$ETCD_VERSION" go_build_etcd
fi
if [ -n "$assets_apiserver$assets_etcd" ]; then
    # envtest's binaries where given: a directory of links, so the cache keeps its own builds.
    out="$cache/with-envtest-assets"
    mkdir -p "$out"
    for name in "${NAMES[@]}"; do ln -sfn "$cache/$name" "$out/$name"; done
    [ -z "$assets_apiserver" ] || ln -sfn "$assets_apiserver" "$out/kube-apiserver"
    [ -z "$assets_etcd" ] || ln -sfn "$assets_etcd" "$out/etcd"
    echo "$out"
else
    echo "$cache"
fi
