#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian 12 machine (run as root, or with sudo available):
# the CI devices' drivers (lavapipe for WebGPU, PoCL for OpenCL, Chromium for the browser
# backend) and a virtual environment in .venv with attnreg installed editable, plus what the
# command at hand runs: `setup.sh demo` (ci/demo.sh) the Dawn extra only; `setup.sh test`
# (ci/test.sh, the default) also the test tools, the clients (torch on the CPU,
# transformers, onnx, onnxruntime) and attnreg.distributed's extra (torch). Safe to run again: it installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-test}
# the CPU build of torch the tests take where one can be found (see below)
TORCH_CPU=2.13.0
case "$what" in
  demo) extras="dawn" ;;
  test) extras="test,dawn,clients,distributed" ;;
  *) echo "usage: ci/setup.sh [demo|test]" >&2; exit 2 ;;
esac

source ci/apt.sh
# chromium: the browser backend's headless Chromium (WebGPU through Dawn/Tint, on SwiftShader).
# gcc + libvulkan-dev: attnreg's pass-through Vulkan ICD, which lets the dawn backend's Dawn
# accept Debian 12's lavapipe (attnreg/vkshim.py).
pkgs=(mesa-vulkan-drivers libvulkan1 pocl-opencl-icd ocl-icd-libopencl1 chromium gcc libvulkan-dev)
# Debian's own python3 needs python3-venv for `python3 -m venv`; other Pythons bring it.
python3 -c 'import ensurepip, venv' 2>/dev/null || pkgs+=(python3-venv python3-pip)
apt_install_missing setup "${pkgs[@]}"

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  python3 -m venv .venv
fi
# Reinstall only when the project's metadata or its package list changed (an editable
# install maps packages found at install time; a new package needs a reinstall).
stamp=.venv/.attnreg-installed-$what
want=$( (cat pyproject.toml; ls -d */__init__.py */*/__init__.py 2>/dev/null) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] pip install -e .[$extras]"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if [ "$what" = test ] && ! .venv/bin/python -c 'import torch' 2>/dev/null; then
    # The tests run torch on the CPU: its CPU build (~0.7 GB installed) where pip can find
    # one (a local wheel, or PyTorch's CPU index), not PyPI's default CUDA build (~5 GB,
    # minutes of CI's set-up for nothing); failing both, the extras below take PyPI's.
    .venv/bin/python -m pip install -q "torch==$TORCH_CPU+cpu" 2>/dev/null \
      || .venv/bin/python -m pip install -q --timeout 20 --retries 0 \
           --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_CPU" 2>/dev/null \
      || echo "[setup] no CPU build of torch $TORCH_CPU found: PyPI's default build follows"
  fi
  .venv/bin/python -m pip install -q -e ".[$extras]"
  # torch's triton (GPU compiler only) brings its own LLVM, which clashes with lavapipe's in
  # one process: building a transformers model after a lavapipe launch segfaulted (measured).
  # CI's torch runs on the CPU, so triton goes.
  .venv/bin/python -m pip uninstall -q -y triton >/dev/null 2>&1 || true
  echo "$want" > "$stamp"
fi
# The Vulkan shim, into ~/.cache/attnreg/vkshim (idempotent: rebuilt only when its source or
# the lavapipe it wraps changed).
.venv/bin/attnreg vk-shim | sed 's/^/[setup] /'
echo "[setup] ready: $(.venv/bin/python --version), attnreg in .venv"
