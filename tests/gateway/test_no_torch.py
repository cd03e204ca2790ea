"""The gateway must import and build its app with torch (and transformers) unimportable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError("blocked for this test: " + name)
        return None
sys.meta_path.insert(0, Block())
try:
    import torch
except ImportError:
    pass
else:
    raise SystemExit("blocker failed")
import gateway.app, gateway.server, pdserve.cli, protocol.messages
from protocol.settings import GatewaySettings
app = gateway.app.create_app(GatewaySettings(tokenizer=sys.argv[1], insecure_control_plane=True))
assert not any(m.split(".")[0] in ("torch", "transformers") for m in sys.modules)
print("ok", len(app.routes))
"""


def test_gateway_imports_without_torch(tokenizer_dir: Path) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tokenizer_dir)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")
