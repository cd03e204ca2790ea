"""scripts/sanitize_kernels.sh's verdicts, with a fake python and a fake compute-sanitizer that write the
summary lines the real tools print (memcheck: "ERROR SUMMARY: N errors"; racecheck: only "RACECHECK
SUMMARY: H hazards displayed (N errors, W warnings)"). A clean racecheck was once reported as FAILED
(H200, 2026-11-29) because the script looked for an ERROR SUMMARY line that racecheck never prints."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON = """#!/usr/bin/env bash
# -c: "is CUDA available" probe -> yes; -m bench.kernels.sanitize_driver -> the driver's last line
[[ "$1" == "-c" ]] && exit 0
echo "sanitize_driver: 1 cases, 3 kernel launches, all match their references"
"""

FAKE_SANITIZER = """#!/usr/bin/env bash
[[ "$1" == "--version" ]] && { echo "fake compute-sanitizer 0"; exit 0; }
tool=""; log=""
while (($#)); do
  case "$1" in --tool) tool=$2; shift 2;; --log-file) log=$2; shift 2;; *) shift;; esac
done
if [[ $tool == memcheck ]]; then
  echo "========= ERROR SUMMARY: $MEM_ERRORS errors" > "$log"
else
  n=$RACE_ERRORS
  echo "========= RACECHECK SUMMARY: $n hazards displayed ($n errors, 0 warnings)" > "$log"
fi
[[ $tool == memcheck && $MEM_ERRORS != 0 || $tool == racecheck && $RACE_ERRORS != 0 ]] && exit 99
exit 0
"""


def _exe(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.mark.parametrize("mem,race,rc,verdicts", [
    (0, 0, 0, ("memcheck: OK, 0 errors", "racecheck: OK, 0 errors")),
    (0, 2, 1, ("memcheck: OK, 0 errors", "racecheck: FAILED, 2 errors, errors reported")),
    (3, 0, 1, ("memcheck: FAILED, 3 errors, errors reported", "racecheck: OK, 0 errors")),
])
def test_sanitize_script_verdicts(tmp_path: Path, mem: int, race: int, rc: int,
                                  verdicts: tuple[str, str]) -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(_exe(tmp_path / "py", FAKE_PYTHON)),
           "COMPUTE_SANITIZER": str(_exe(tmp_path / "cs", FAKE_SANITIZER)),
           "MEM_ERRORS": str(mem), "RACE_ERRORS": str(race)}
    res = subprocess.run(["bash", "scripts/sanitize_kernels.sh", str(tmp_path / "logs")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == rc, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    for verdict in verdicts:
        assert any(line.startswith(verdict) for line in lines), (verdict, res.stdout)
