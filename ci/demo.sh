#!/usr/bin/env bash
# The README's main job: set up, list the devices, run a prefill and a decode on every backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup.sh demo
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}" PATH="$PWD/.venv/bin:$PATH"
attnreg devices
echo
attnreg demo "$@"
