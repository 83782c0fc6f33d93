#!/usr/bin/env bash
# Installs clang, its sanitizer runtimes and llvm-symbolizer from Debian's
# packages when clang is missing, for `make sanitize`. Without root or apt,
# run.py falls back to gcc's libasan, and says so.
set -u
if command -v clang >/dev/null 2>&1 || command -v clang-14 >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "[sanitize] no clang and no apt-get: building with gcc's libasan"
    exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; else
        echo "[sanitize] no clang, and no root to install it: building with gcc's libasan"
        exit 0
    fi
fi
install() {
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        clang-14 libclang-rt-14-dev llvm-14 >/dev/null
}
# the package lists may be missing on a fresh machine: refreshed only if needed
install || { $sudo apt-get update -q >/dev/null && install; } \
    || echo "[sanitize] clang could not be installed: building with gcc's libasan"
exit 0
