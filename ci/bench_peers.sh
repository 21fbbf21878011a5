#!/usr/bin/env bash
# Idempotent set-up of the optional comparison peers for `attnreg bench` (attnreg/peers/):
#   - onnxruntime-webgpu 1.27.0 and onnx (the ONNX Runtime WebGPU EP peer),
#   - libvulkan-dev (headers) and the lavapipe pass-through ICD shim that lets Dawn, inside
#     onnxruntime-webgpu, accept Debian 12's Mesa 22.3 lavapipe; built into .peers/ (ignored).
# Installs into the repo's .venv when it exists, else into the current python3.
# torch is not installed here (large; `pip install torch` adds the CPU build if wanted).
# Safe to run again: every step checks first and does only what is missing.
# Usage: bash ci/bench_peers.sh            (then: attnreg bench ... picks the peers up)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

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

# 3. the lavapipe shim (only useful where lavapipe is the Vulkan driver; harmless elsewhere).
shim_src=""
for d in "$root/../shared/tools/lvp-dawn-shim" "$root/shared/tools/lvp-dawn-shim" /work/shared/tools/lvp-dawn-shim; do
  if [ -f "$d/build.sh" ] && [ -f "$d/lvp_shim.c" ]; then shim_src=$(cd "$d" && pwd); break; fi
done
out="$root/.peers/lvp-dawn-shim"
if [ -z "$shim_src" ]; then
  echo "[peers] lvp-dawn-shim sources not found (../shared/tools/lvp-dawn-shim); skipping the shim"
elif [ ! -f /usr/lib/x86_64-linux-gnu/libvulkan_lvp.so ]; then
  echo "[peers] lavapipe (libvulkan_lvp.so) not found; skipping the shim"
elif [ -f "$out/libvk_lvp_shim.so" ] && [ -f "$out/lvp_shim_icd.json" ] \
     && [ "$out/libvk_lvp_shim.so" -nt "$shim_src/lvp_shim.c" ] \
     && grep -q "$out/libvk_lvp_shim.so" "$out/lvp_shim_icd.json"; then
  echo "[peers] shim up to date: $out/lvp_shim_icd.json"
else
  mkdir -p "$out"
  sh "$shim_src/build.sh" "$out"
fi

"$PY" - <<'PY'
from attnreg.tools import peers
print("[peers] onnxruntime-webgpu:", peers.ort_webgpu_status() or "usable")
print("[peers] torch:", peers.torch_status() or "usable")
PY
