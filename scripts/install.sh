#!/usr/bin/env bash
# Installs spade_jax on a fresh Debian/Ubuntu machine or Cloud TPU VM.
#
#   bash scripts/install.sh                        # into the first Python >= 3.11 found
#   bash scripts/install.sh --test                 # + test-only references (transformers, CPU
#                                                  #   torch) and libtpu for the AOT-plan tests
#   bash scripts/install.sh --tpu --venv DIR       # a TPU VM: a Python 3.11+ virtual
#                                                  #   environment at DIR, the project and
#                                                  #   jax[tpu] in one pip resolution pinned by
#                                                  #   scripts/constraints-tpu.txt
#   bash scripts/install.sh --print-python [--venv DIR]   # the interpreter it would use
#
# Python: $SPADE_PYTHON if set, else the first of python3 python python3.11 python3.12
# python3.13 on PATH that is 3.11+ (and, for --venv, has the venv module): the default
# interpreter when it is new enough, a versioned one when it is older (the TPU images'
# Ubuntu 22.04 ships 3.10 as python3, and no `python`). None: with --venv, apt's python3.11
# + python3.11-venv (Ubuntu 22.04 universe), else uv (`uv venv --python 3.11`, a standalone
# CPython), else an error naming the ways to get one.
# Bubblewrap (the sandbox's namespaces) is installed with apt; if it cannot be, the script
# stops with an error (--without-bwrap: a warning instead, and runs need --allow_weak_sandbox).
set -euo pipefail
cd "$(dirname "$0")/.."

extras=()
venv=""
print_only=0
require_bwrap=1
while [ $# -gt 0 ]; do
  case "$1" in
    --test) extras+=(test aot) ;;
    --tpu) extras+=(tpu) ;;
    --venv) [ $# -ge 2 ] || { echo "error: --venv needs a directory" >&2; exit 2; }
            venv="$2"; shift ;;
    --venv=*) venv="${1#--venv=}" ;;
    --print-python) print_only=1 ;;
    --without-bwrap) require_bwrap=0 ;;
    *) echo "error: unknown option '$1' (see the top of scripts/install.sh)" >&2; exit 2 ;;
  esac
  shift
done

SUDO=""
if [ "$(id -u 2>/dev/null || echo 0)" != 0 ]; then SUDO="sudo"; fi

version_ok() {  # a Python 3.11 or newer
  "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' >/dev/null 2>&1
}
can_make_venv() {  # Debian's python3.X needs python3.X-venv for `-m venv`
  "$1" -c 'import ensurepip, venv' >/dev/null 2>&1
}
find_python() {
  local name path
  for name in ${SPADE_PYTHON:-} python3 python python3.11 python3.12 python3.13; do
    path=$(command -v "$name" 2>/dev/null) || continue
    version_ok "$path" || continue
    if [ -n "$venv" ] && ! can_make_venv "$path"; then
      echo "note: $path is 3.11+ but cannot make a virtual environment (no venv/ensurepip)" >&2
      continue
    fi
    echo "$path"
    return 0
  done
  return 1
}

python_bin=""
if python_bin=$(find_python); then :; else python_bin=""; fi
if [ "$print_only" = 1 ]; then
  if [ -z "$python_bin" ]; then echo "no Python 3.11+ on PATH" >&2; exit 1; fi
  echo "$python_bin"
  exit 0
fi

# ---- system packages: bubblewrap (the sandbox's namespaces), a 3.11+ Python if needed ----
apt_install() {
  command -v apt-get >/dev/null 2>&1 || return 1
  $SUDO apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}

if ! command -v bwrap >/dev/null 2>&1; then
  apt_install bubblewrap || true
fi
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$require_bwrap" = 1 ]; then
    echo "error: bubblewrap (bwrap) is not installed and could not be installed with apt-get;" \
         "the sandbox needs it to isolate designer programs. Install it" \
         "(sudo apt-get install bubblewrap) and run this again, or pass --without-bwrap" \
         "(runs then need --allow_weak_sandbox)." >&2
    exit 1
  fi
  echo "warning: no bubblewrap: runs need --allow_weak_sandbox" >&2
fi

if [ -z "$python_bin" ] && [ -n "$venv" ]; then
  if apt_install python3.11 python3.11-venv; then
    python_bin=$(find_python) || python_bin=""
  fi
fi

# ---- the environment --------------------------------------------------------------------
if [ -n "$venv" ]; then
  if [ -x "$venv/bin/python" ] && version_ok "$venv/bin/python"; then
    echo "using the existing virtual environment $venv" >&2
  elif [ -n "$python_bin" ]; then
    "$python_bin" -m venv "$venv"
  elif command -v uv >/dev/null 2>&1; then
    uv venv --seed --python 3.11 "$venv"  # downloads a standalone CPython 3.11 if needed
  else
    echo "error: no Python 3.11+ found (tried \$SPADE_PYTHON, python3, python, python3.11," \
         "python3.12, python3.13), apt-get could not install python3.11 and uv is not" \
         "installed. Install one: 'sudo apt-get install python3.11 python3.11-venv'," \
         "or uv (https://docs.astral.sh/uv/) so that 'uv venv --python 3.11' works," \
         "or set SPADE_PYTHON=/path/to/python3.11." >&2
    exit 1
  fi
  python_bin="$venv/bin/python"
elif [ -z "$python_bin" ]; then
  echo "error: no Python 3.11+ on PATH (spade_jax and jax need 3.11+); pass --venv DIR to" \
       "make a virtual environment with one installed for it, or set SPADE_PYTHON." >&2
  exit 1
fi

# ---- the project: one pip resolution (extras together, pinned on a TPU VM) ---------------
spec="."
if [ ${#extras[@]} -gt 0 ]; then spec=".[$(IFS=,; echo "${extras[*]}")]"; fi
pin=()
case " ${extras[*]:-} " in *" tpu "*) pin=(-c scripts/constraints-tpu.txt) ;; esac
if [ -n "$venv" ]; then
  "$python_bin" -m pip install -q --disable-pip-version-check --upgrade pip
fi
"$python_bin" -m pip install -q --disable-pip-version-check "${pin[@]}" -e "$spec"
# The sandbox's seccomp layer imports pyseccomp from this environment (not ~/.local).
"$python_bin" -c "import pyseccomp, spade_jax" || {
  echo "error: $python_bin cannot import pyseccomp / spade_jax after the install" >&2; exit 1; }
echo "installed spade_jax into $python_bin ($("$python_bin" -c 'import sys; print(sys.version.split()[0])'))"
