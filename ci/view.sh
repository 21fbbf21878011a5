#!/usr/bin/env bash
# Builds .view/attnreg: the installed package's layout made of links into this checkout
# (attnreg/* plus backends/, shaders/ and kernels_cl/ under it), for the tools that read
# packages from disk rather than importing them: mypy and import-linter.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
rm -rf .view
mkdir -p .view/attnreg
for f in attnreg/*; do
  case "$(basename "$f")" in __pycache__) continue ;; esac
  ln -s "$root/$f" ".view/attnreg/$(basename "$f")"
done
for d in backends shaders kernels_cl; do ln -s "$root/$d" ".view/attnreg/$d"; done
