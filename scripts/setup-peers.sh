#!/usr/bin/env bash
# Set up the benchmark peers for `moeswap bench decode|prefill|serve` (see docs/benchmarks.md).
#   llama.cpp : llama-cpp-python 0.3.36 built from the PyPI sdist into the venv (CPU only, no
#               tests/tools/examples/server/mtmd: the quickest build that can run a GGUF), and the
#               sdist's own HF->GGUF converter extracted to .peers/llama.cpp/ (run with the venv's python).
#   llama-server: llama.cpp's own HTTP server from the same sdist's sources (bench serve's peer), built
#               alone into .peers/bin/llama-server (static, CPU only, no web UI).
#   transformers: already a moeswap dependency (KimiLinearForCausalLM); nothing to do.
# Usage: scripts/setup-peers.sh [--python PATH] [--jobs N] [--no-build] [--no-library] [--no-server]
#   --no-library: skip llama-cpp-python (bench serve needs only llama-server and the converter)
# Idempotent: the sdist and the extracted converter are cached in .peers/, the CMake build dirs too.
set -euo pipefail

VERSION=0.3.36
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PEERS="$ROOT/.peers"
PY="$ROOT/.venv/bin/python"
JOBS="$(nproc 2>/dev/null || echo 2)"
BUILD=1
LIBRARY=1
SERVER=1
while [ $# -gt 0 ]; do
    case "$1" in
        --python) PY="$2"; shift 2 ;;
        --jobs) JOBS="$2"; shift 2 ;;
        --no-build) BUILD=0; shift ;;
        --no-library) LIBRARY=0; shift ;;
        --no-server) SERVER=0; shift ;;
        -h|--help) sed -n 2,11p "$0"; exit 0 ;;
        *) echo "setup-peers.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
    esac
done
[ -x "$PY" ] || { echo "setup-peers.sh: no python at $PY; create the venv first or pass --python" >&2; exit 2; }
for tool in cmake cc c++; do
    command -v "$tool" >/dev/null || { echo "setup-peers.sh: '$tool' not found; install a C/C++ toolchain and cmake (apt-get install build-essential cmake)" >&2; exit 2; }
done

mkdir -p "$PEERS"
SDIST="$PEERS/llama_cpp_python-$VERSION.tar.gz"
SRC="$PEERS/llama_cpp_python-$VERSION"

# 1. The sdist (source only, never a prebuilt wheel).
if [ ! -f "$SDIST" ]; then
    "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$PEERS"
fi
[ -d "$SRC" ] || tar -xzf "$SDIST" -C "$PEERS"

# 2. The converter: convert_hf_to_gguf.py + conversion/ + gguf-py/ from the same llama.cpp revision.
#    gguf-py is found next to the script; sentencepiece is only needed for other models.
CONV="$PEERS/llama.cpp"
#    models/templates/ holds the chat templates the converter embeds when a model ships none.
if [ ! -f "$CONV/models/templates/Kimi-K3.jinja" ]; then
    mkdir -p "$CONV/models"
    cp -r "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" "$SRC/vendor/llama.cpp/conversion" \
          "$SRC/vendor/llama.cpp/gguf-py" "$CONV/"
    cp -r "$SRC/vendor/llama.cpp/models/templates" "$CONV/models/"
fi
echo "converter: $PY $CONV/convert_hf_to_gguf.py"

# 3. The library. GGML_NATIVE: tuned for this CPU like a local llama.cpp build would be.
if [ "$BUILD" = 1 ] && [ "$LIBRARY" = 1 ]; then
    if "$PY" -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.__version__ == '$VERSION' else 1)" 2>/dev/null; then
        echo "llama-cpp-python $VERSION already installed"
    else
        export CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
-DGGML_BLAS=OFF -DGGML_RPC=OFF -DGGML_OPENMP=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
-DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release"
        export CMAKE_BUILD_PARALLEL_LEVEL="$JOBS"
        command -v ninja >/dev/null && export CMAKE_GENERATOR=Ninja
        # build-dir: a rerun after an interrupted build continues instead of starting over.
        "$PY" -m pip install --no-binary llama-cpp-python \
            -C "build-dir=$PEERS/build" "$SDIST"
    fi
    "$PY" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ok')"
fi

# 4. llama-server: a CMake build of the sdist's vendored llama.cpp of its own (step 3 leaves the server out);
#    only the llama-server target and what it links are compiled (~200 compile steps). The web UI is off:
#    its assets would be downloaded, and the benchmark never loads them.
if [ "$BUILD" = 1 ] && [ "$SERVER" = 1 ]; then
    if [ -x "$PEERS/bin/llama-server" ]; then
        echo "llama-server already built"
    else
        GENERATOR=()
        command -v ninja >/dev/null && GENERATOR=(-G Ninja)
        cmake -S "$SRC/vendor/llama.cpp" -B "$PEERS/server-build" ${GENERATOR[@]+"${GENERATOR[@]}"} -DCMAKE_BUILD_TYPE=Release \
            -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
            -DGGML_BLAS=OFF -DGGML_RPC=OFF -DGGML_OPENMP=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
            -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
            -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
        cmake --build "$PEERS/server-build" --target llama-server -j "$JOBS"
        mkdir -p "$PEERS/bin"
        cp "$PEERS/server-build/bin/llama-server" "$PEERS/bin/llama-server"
    fi
    echo "llama-server: $("$PEERS/bin/llama-server" --version 2>&1 | grep '^version' || true)"
fi
