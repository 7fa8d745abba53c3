#!/usr/bin/env bash
# Build llama.cpp's llama-server once per machine and print the binary's path (bench/demo_vs_llamacpp.py
# runs it beside our server). The source is the llama.cpp tree that the llama-cpp-python source
# distribution on PyPI vendors, fetched with pip, so only the package registry is needed.
# Needs cmake (apt's or `pip install cmake`), gcc/g++; about 10 minutes on 2 cores.
#
#   LLAMA_SERVER=$(bench/build_llama_server.sh)
#
# Cached under $LLAMASERVE_PEERS_CACHE (default ~/.cache/llamaserve-peers): a second run prints the
# path at once. Run the binary with LD_LIBRARY_PATH set to its folder if the loader misses its
# shared libraries (demo_vs_llamacpp.py does).
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE=${LLAMASERVE_PEERS_CACHE:-$HOME/.cache/llamaserve-peers}
BIN="$CACHE/llama.cpp-$VERSION/build/bin/llama-server"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
if ! command -v cmake >/dev/null; then
    echo "cmake not found: installing it from PyPI (pip install cmake)" >&2
    python3 -m pip install -q cmake >&2
fi
mkdir -p "$CACHE/sdist"
echo "fetching llama-cpp-python==$VERSION's source from PyPI ..." >&2
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE/sdist" >&2
rm -rf "$CACHE/src" && mkdir -p "$CACHE/src"
tar -xzf "$CACHE/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE/src"
rm -rf "$CACHE/llama.cpp-$VERSION"
mv "$CACHE/src/llama_cpp_python-$VERSION/vendor/llama.cpp" "$CACHE/llama.cpp-$VERSION"
cd "$CACHE/llama.cpp-$VERSION"
echo "building llama-server in $PWD/build (cmake prints [percent] progress) ..." >&2
cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build build --target llama-server -j "$(nproc)" >&2
echo "$BIN"
