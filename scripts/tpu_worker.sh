#!/usr/bin/env bash
# What `launch/tpu.py` runs on every worker of a TPU VM slice (through
# `gcloud compute tpus tpu-vm ssh --worker=all`), from the shipped checkout.
#
#   bash scripts/tpu_worker.sh clear                  # free the TPU for a new run
#   bash scripts/tpu_worker.sh start [KEY=VALUE ...] -- TRAIN_ARGS...
#   bash scripts/tpu_worker.sh stop [TIMEOUT_S]       # SIGTERM (save first), wait
#   bash scripts/tpu_worker.sh status
#
# start runs `python -m spade_jax.train TRAIN_ARGS` from the virtual environment
# ($SPADE_VENV, default ~/spade_jax/venv) as root (the sandbox gives each designer-program
# worker its own uid, which needs root), detached in its own session, with
# SPADE_JAX_DISTRIBUTED=1 (every worker joins one jax.distributed job; JAX finds the others
# through the TPU metadata) and the KEY=VALUE pairs in its environment; output goes to
# $SPADE_LOG (default ~/spade_jax.log). It refuses when a trainer is already running.
set -euo pipefail

VENV="${SPADE_VENV:-$HOME/spade_jax/venv}"
LOG="${SPADE_LOG:-$HOME/spade_jax.log}"
LOCKFILE="${SPADE_TPU_LOCKFILE:-/tmp/libtpu_lockfile}"
# The brackets keep this shell's own command line out of the match.
PATTERN="${SPADE_TRAINER_PATTERN:-[s]pade_jax[.]train}"
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo -n"; fi

trainers() { pgrep -f "$PATTERN" || true; }

# TPU chips: /dev/accelN (v4, v5e) or /dev/vfio/N (v5p, v6e).
DEVICES="${SPADE_TPU_DEVICE_REGEX:-^/dev/(accel[0-9]+|vfio/[0-9]+)$}"

tpu_holders() {  # pids with a TPU chip open
  local fd pid
  for fd in /proc/[0-9]*/fd/*; do
    if [[ "$(readlink "$fd" 2>/dev/null)" =~ $DEVICES ]]; then
      pid="${fd#/proc/}"; echo "${pid%%/*}"
    fi
  done | sort -u
}

clear_tpu() {
  if [ -n "$(trainers)" ]; then
    echo "error: spade_jax.train is already running on $(hostname) (pids $(trainers | tr '\n' ' '))" \
         "- stop it first: launch/tpu.py stop" >&2
    exit 1
  fi
  local holders
  holders=$(tpu_holders)
  if [ -n "$holders" ]; then  # a crashed run's leftovers keep the chips open
    echo "killing stale TPU holders on $(hostname): $holders" >&2
    # shellcheck disable=SC2086
    $SUDO kill -9 $holders 2>/dev/null || true
  fi
  $SUDO rm -f "$LOCKFILE"
}

case "${1:-}" in
  clear)
    clear_tpu ;;
  start)
    shift
    env_pairs=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do env_pairs+=("$1"); shift; done
    [ "${1:-}" = "--" ] || { echo "error: start needs '--' before the trainer's arguments" >&2; exit 2; }
    shift
    [ -x "$VENV/bin/python" ] || { echo "error: no $VENV/bin/python: run launch/tpu.py install" >&2; exit 1; }
    clear_tpu
    # shellcheck disable=SC2086
    $SUDO setsid env SPADE_JAX_DISTRIBUTED=1 "${env_pairs[@]}" \
      "$VENV/bin/python" -m spade_jax.train "$@" > "$LOG" 2>&1 < /dev/null &
    echo "started spade_jax.train on $(hostname); log: $LOG" ;;
  stop)
    timeout_s="${2:-600}"
    if [ -z "$(trainers)" ]; then echo "no spade_jax.train running on $(hostname)"; exit 0; fi
    # SIGTERM, not SIGINT: the trainer saves a checkpoint at its next safe point, then exits.
    $SUDO pkill -TERM -f "$PATTERN" || true
    waited=0
    while [ -n "$(trainers)" ]; do
      if [ "$waited" -ge "$timeout_s" ]; then
        echo "error: spade_jax.train still running on $(hostname) after ${timeout_s}s" >&2
        exit 1
      fi
      sleep 1; waited=$((waited + 1))
    done
    echo "spade_jax.train stopped on $(hostname) after ${waited}s" ;;
  status)
    if [ -n "$(trainers)" ]; then echo "running on $(hostname): $(trainers | tr '\n' ' ')"
    else echo "not running on $(hostname)"; fi ;;
  *)
    echo "usage: tpu_worker.sh clear | start [KEY=VALUE ...] -- ARGS | stop [TIMEOUT_S] | status" >&2
    exit 2 ;;
esac
