#!/usr/bin/env bash
# Builds .view/attnreg: the installed package's layout (backends/, shaders/ and kernels_cl/
# under attnreg/) as real folders of links to this checkout's files, for the tools that read
# packages from disk instead of importing them: mypy and import-linter.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
rm -rf .view
mkdir -p .view
cp -as "$root/attnreg" .view/attnreg
for d in backends shaders kernels_cl; do cp -as "$root/$d" ".view/attnreg/$d"; done
find .view -name __pycache__ -prune -exec rm -rf {} +
