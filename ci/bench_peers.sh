#!/usr/bin/env bash
# Idempotent set-up of the optional comparison peers for `attnreg bench` (attnreg/tools/peers/):
#   - onnxruntime-webgpu 1.27.0 and onnx (the ONNX Runtime WebGPU EP peer),
#   - libvulkan-dev (headers) and attnreg's lavapipe pass-through ICD (`attnreg vk-shim`,
#     attnreg/vkshim.py) that lets Dawn, inside onnxruntime-webgpu, accept Debian 12's Mesa
#     22.3 lavapipe; built into ~/.cache/attnreg/vkshim.
# Installs into the repo's .venv when it exists, else into the current python3.
# torch is not installed here (large; `pip install torch` adds the CPU build if wanted).
# Safe to run again: every step checks first and does only what is missing.
# Usage: bash ci/bench_peers.sh            (then: attnreg bench ... picks the peers up)
set -euo pipefail
cd "$(dirname "$0")/.."

source ci/apt.sh

# 1. system packages: the Vulkan headers, lavapipe and a C compiler for the shim.
apt_install_missing peers libvulkan-dev mesa-vulkan-drivers gcc

# 2. python packages.
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=$(command -v python3); fi
want_ort=1.27.0
have_ort=$("$PY" -c 'import importlib.metadata as m; print(m.version("onnxruntime-webgpu"))' 2>/dev/null || true)
have_onnx=$("$PY" -c 'import onnx; print(onnx.__version__)' 2>/dev/null || true)
if [ "$have_ort" != "$want_ort" ] || [ -z "$have_onnx" ]; then
  # A plain `onnxruntime` (CPU or GPU build) owns the same import name and would shadow or
  # be shadowed by the WebGPU build; say so rather than silently removing a user's package.
  for other in onnxruntime onnxruntime-gpu; do
    if "$PY" -c "import importlib.metadata as m; m.version('$other')" 2>/dev/null; then
      echo "[peers] note: $other is also installed and shares the 'onnxruntime' module name;" \
           "uninstall it if 'WebGpuExecutionProvider' is missing from get_available_providers()"
    fi
  done
  echo "[peers] $PY -m pip install onnxruntime-webgpu==$want_ort onnx"
  "$PY" -m pip install -q "onnxruntime-webgpu==$want_ort" onnx
fi

# 3. the lavapipe shim: attnreg's own pass-through ICD (attnreg/vkshim.py), built into the user
#    cache; the ORT peer swaps it in for lavapipe before its first WebGPU session.
if ! "$PY" -m attnreg.tools.cli vk-shim; then
  echo "[peers] the Vulkan shim could not be built; ORT WebGPU will not see lavapipe"
fi

"$PY" - <<'PY'
from attnreg.tools import peers
print("[peers] onnxruntime-webgpu:", peers.ort_webgpu_status() or "usable")
print("[peers] torch:", peers.torch_status() or "usable")
PY
