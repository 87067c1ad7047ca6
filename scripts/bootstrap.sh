#!/usr/bin/env bash
# Sets up Python for this checkout. Two layers, so that a fresh clone costs seconds once the machine
# has the heavy wheels (torch is several GB):
#   $PREEMPTIBLE_CACHE/venv   third-party dependencies from pyproject.toml, shared by every checkout
#   <checkout>/.venv          this checkout, installed editable; sees the shared layer through a .pth
set -euo pipefail
cd "$(dirname "$0")/.."
# Every Python started here runs with -P: the checkout root must not be put on sys.path, where our
# operator/ directory would shadow the standard-library module `operator`.
CACHE="${PREEMPTIBLE_CACHE:-$HOME/.cache/preemptible}"
BASE="$CACHE/venv"
LOCAL="$PWD/.venv"
mkdir -p "$CACHE"

if [ ! -x "$BASE/bin/python" ]; then
  echo "==> creating the shared dependency environment in $BASE"
  python3 -P -m venv "$BASE"
  "$BASE/bin/python" -P -m pip install -q --disable-pip-version-check --upgrade pip
fi
echo "==> installing dependencies from pyproject.toml into $BASE (the first time includes torch: several minutes)"
"$BASE/bin/python" -P - <<'PY' > "$CACHE/requirements.txt"
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = list(project["dependencies"]) + list(project["optional-dependencies"]["dev"])
print("\n".join(deps + ["setuptools>=68", "wheel"]))
PY
"$BASE/bin/python" -P -m pip install -q --disable-pip-version-check -r "$CACHE/requirements.txt"

if [ ! -x "$LOCAL/bin/python" ]; then
  echo "==> creating $LOCAL"
  python3 -P -m venv --without-pip "$LOCAL"
fi
site_local=$("$LOCAL/bin/python" -P -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
site_base=$("$BASE/bin/python" -P -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# addsitedir (not a bare path line) so the shared layer's own .pth hooks run too. The explicit
# `import operator` pins the standard-library module before a checkout root on sys.path could
# shadow it with our operator/ directory (the import package is preemptible_operator).
echo "import operator, site; site.addsitedir('$site_base')" > "$site_local/_preemptible_shared_deps.pth"
echo "==> installing preemptible (editable) into $LOCAL"
"$BASE/bin/python" -P -m pip --python "$LOCAL/bin/python" install -q --disable-pip-version-check \
  --no-deps --no-build-isolation -e .
