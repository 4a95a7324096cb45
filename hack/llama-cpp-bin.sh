#!/usr/bin/env bash
# Provides a CPU build of llama.cpp for the peer benchmark (hack/bench_llama_cpp.py)
# and prints the directory that holds its binaries:
#
#     llama-server, llama-bench, llama-batched-bench, llama-speculative-simple,
#     llama-tokenize                          llama.cpp as vendored by the PyPI sdist
#                                             llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION
#
#     bash hack/llama-cpp-bin.sh              # build what is missing, print the bin directory
#     MTP_LLAMA_CPP_BIN=DIR ...               # use DIR's binaries instead (nothing is built)
#     MTP_LLAMA_CPP_SDIST=FILE ...            # build from this sdist instead of fetching it
#
# The sdist is fetched with pip (the package index's ordinary client; pip builds
# its metadata in an isolated environment, so that step fetches scikit-build-core)
# and checked against a pinned SHA-256. The build is Release, CPU only
# (GGML_NATIVE), static, without HTTPS or the web UI (nothing is downloaded at
# build time), and makes only the targets above. It is cached by version under
# ${XDG_CACHE_HOME:-~/.cache}/mtp-operator/llama.cpp/<version>/, beside the
# vendored gguf-py and convert_hf_to_gguf.py (the benchmark's GGUF writer uses
# that gguf-py, so the two always match). A cold build takes about 15 minutes
# on 2 cores, a cached one nothing. None of llama.cpp's code is in this repository.
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_CPP_PYTHON_VERSION=0.3.36
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
NAMES=(llama-server llama-bench llama-batched-bench llama-speculative-simple llama-tokenize)
JOBS=${MTP_LLAMA_CPP_JOBS:-2}

log() { echo "llama-cpp-bin: $*" >&2; }

if [ -n "${MTP_LLAMA_CPP_BIN:-}" ]; then
    for name in llama-server llama-bench llama-batched-bench; do
        if [ ! -x "$MTP_LLAMA_CPP_BIN/$name" ]; then
            log "MTP_LLAMA_CPP_BIN=$MTP_LLAMA_CPP_BIN has no executable $name"
            exit 1
        fi
    done
    echo "$MTP_LLAMA_CPP_BIN"
    exit 0
fi

root="${XDG_CACHE_HOME:-$HOME/.cache}/mtp-operator/llama.cpp"
cache="$root/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION"
if [ -x "$cache/bin/llama-server" ]; then
    echo "$cache/bin"
    exit 0
fi
for tool in cmake c++ python3; do
    if ! command -v "$tool" >/dev/null; then
        log "building llama.cpp needs $tool on PATH; or set MTP_LLAMA_CPP_BIN to a directory with ${NAMES[*]}"
        exit 1
    fi
done

# The build goes to a temporary directory and is renamed into place, so an
# interrupted build never leaves a cache that looks finished.
mkdir -p "$root"
tmp="$(mktemp -d "$root/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
if [ -n "${MTP_LLAMA_CPP_SDIST:-}" ]; then
    sdist="$MTP_LLAMA_CPP_SDIST"
else
    log "fetching the llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION sdist"
    python3 -m pip download --quiet --no-deps --no-binary :all: -d "$tmp/dl" \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" >&2
    sdist="$tmp/dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
fi
got="$(sha256sum "$sdist" | cut -d' ' -f1)"
if [ "$got" != "$SDIST_SHA256" ]; then
    log "$sdist has SHA-256 $got, want $SDIST_SHA256"
    exit 1
fi
top="llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
tar -xzf "$sdist" -C "$tmp" "$top/vendor/llama.cpp"
src="$tmp/$top/vendor/llama.cpp"

log "building ${NAMES[*]} into $cache (once per version; about 15 minutes on 2 cores)"
cmake -S "$src" -B "$tmp/build" -G "$(command -v ninja >/dev/null && echo Ninja || echo 'Unix Makefiles')" \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF -DGGML_OPENMP=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_NUMBER=0 >&2
cmake --build "$tmp/build" -j "$JOBS" --target "${NAMES[@]}" >&2

out="$tmp/out"
mkdir -p "$out/bin"
for name in "${NAMES[@]}"; do cp "$tmp/build/bin/$name" "$out/bin/"; done
cp -r "$src/gguf-py" "$out/gguf-py"
cp "$src/convert_hf_to_gguf.py" "$out/"
[ ! -d "$src/conversion" ] || cp -r "$src/conversion" "$out/conversion"
cp "$src/LICENSE" "$out/LICENSE"
"$out/bin/llama-server" --version >"$out/version.txt" 2>&1 || true
rm -rf "$cache"
mv "$out" "$cache"
log "built in $((SECONDS - start)) s"
echo "$cache/bin"
