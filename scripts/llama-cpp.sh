# Sourced by scripts/bench-compare and scripts/llama-oracle: llama.cpp's sources and a cmake to build them.
# The caller defines LLAMA_DIR (where the sdist goes), say and die.

# cmake on PATH, else the one of pip's cmake package (installed when missing).
find_cmake() {
    if command -v cmake >/dev/null; then
        command -v cmake
        return
    fi
    if ! python3 -c 'import cmake' 2>/dev/null; then
        say "installing cmake with pip"
        python3 -m pip install --quiet cmake >&2 || die "pip install cmake failed"
    fi
    python3 -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))'
}

# The vendor/llama.cpp tree of the llama-cpp-python sdist, downloaded and extracted under target/llama-cpp/.
llama_source() {
    local sdist
    sdist=$(ls "$LLAMA_DIR"/llama_cpp_python-*.tar.gz 2>/dev/null | head -n 1 || true)
    if [[ -z "$sdist" ]]; then
        say "downloading the llama-cpp-python source distribution"
        mkdir -p "$LLAMA_DIR"
        python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python llama-cpp-python \
            -d "$LLAMA_DIR" >&2 || die "pip download of llama-cpp-python failed"
        sdist=$(ls "$LLAMA_DIR"/llama_cpp_python-*.tar.gz 2>/dev/null | head -n 1 || true)
        [[ -n "$sdist" ]] || die "pip download left no llama_cpp_python-*.tar.gz in $LLAMA_DIR"
    fi
    local dir=${sdist%.tar.gz}
    if [[ ! -f "$dir/vendor/llama.cpp/CMakeLists.txt" ]]; then
        tar -xzf "$sdist" -C "$LLAMA_DIR" || die "cannot extract $sdist"
    fi
    [[ -f "$dir/vendor/llama.cpp/CMakeLists.txt" ]] || die "$sdist has no vendor/llama.cpp"
    echo "$dir/vendor/llama.cpp"
}
