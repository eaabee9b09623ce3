#!/usr/bin/env bash
# Installs everything spade_jax needs on a fresh Debian/Ubuntu machine (or TPU VM).
#   bash scripts/install.sh          # runtime
#   bash scripts/install.sh --test   # runtime + test-only references (transformers, CPU torch)
#                                    # + libtpu, so the TPU AOT-plan tests compile for real
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages: bubblewrap gives the environment sandbox its namespaces.
if ! command -v bwrap >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq >/dev/null || true
    $SUDO apt-get install -y -qq bubblewrap >/dev/null || echo "warning: could not install bubblewrap" >&2
  else
    echo "warning: no apt-get; install bubblewrap yourself for the full sandbox" >&2
  fi
fi

extra=""
[ "${1:-}" = "--test" ] && extra="[test,aot]"
python -m pip install -q --disable-pip-version-check -e ".${extra}"
