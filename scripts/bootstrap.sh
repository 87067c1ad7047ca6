#!/usr/bin/env bash
# Creates (once) the project's virtual environment outside the repository and installs the project
# into it. Everything lives under PREEMPTIBLE_CACHE so a fresh clone reuses torch and friends.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${PREEMPTIBLE_CACHE:-$HOME/.cache/preemptible}"
VENV="$CACHE/venv"
mkdir -p "$CACHE"
if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating virtual environment in $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
fi
echo "==> installing preemptible (editable) and its dependencies into $VENV"
"$VENV/bin/pip" install -q --disable-pip-version-check -e ".[dev]"
