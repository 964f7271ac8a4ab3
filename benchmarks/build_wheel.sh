#!/usr/bin/env bash
# Build the project's wheel from HEAD (not the working tree) into .whl/ for the GPU machine.
set -euo pipefail
top=$(git rev-parse --show-toplevel); tmp=$(mktemp -d)
git -C "$top" archive HEAD | tar -x -C "$tmp"
rm -f "$top"/.whl/flashtune-*.whl
python3 -m pip wheel -q --no-deps --no-build-isolation -w "$top/.whl" "$tmp" 2>&1 | grep -v WARN || true
rm -rf "$tmp"; ls "$top"/.whl | grep flashtune
