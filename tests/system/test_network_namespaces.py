"""Across hosts, as far as one machine can show it: two network namespaces joined by a veth pair, with
distinct addresses. Namespace a holds a gateway and the prefill worker, namespace b a second gateway and
the decode worker; every process binds its namespace's veth address, so nothing can reach it over
127.0.0.1, and the KV crosses between the namespaces over NIXL with UCX restricted to TCP
(``UCX_TLS=tcp``, as between hosts without RDMA; each worker puts UCX on the interface that holds its
``--host`` address by itself). Both workers register with both gateways; requests go through each
gateway (the ``openai`` client, run inside namespace a) and are served disaggregated, greedy answers
equal through both, the KV blocks are all free afterwards, and every socket listening in either
namespace is on that namespace's address (none on a loopback or wildcard address). Needs root and
iproute2 (CI runs as root); the namespaces and the veth pair are removed at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtransfer.curve import generate_keys
from pdserve.live_system import MODEL
from pdserve.supervisor import Supervisor

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                 reason="needs root and iproute2 to make network namespaces")]

ROOT = Path(__file__).resolve().parents[2]
HTTP_PORT, CONTROL_PORT = 8000, 7100
WORKERS = {"prefill": "netns-prefill", "decode": "netns-decode"}

# the client, run inside namespace a: waits for both gateways to hold both workers, then sends requests
# through each and prints what it got as one JSON line
CLIENT = r"""
import json, sys, time
import httpx, openai
from pdserve.live_system import registered
urls, model, workers = sys.argv[1].split(","), sys.argv[2], set(sys.argv[3].split(","))
def ready(url):
    try:
        return httpx.get(url + "/ready", timeout=2).status_code == 200 and workers <= registered(url)
    except httpx.HTTPError:
        return False
deadline = time.monotonic() + 240
while not all(ready(u) for u in urls):
    if time.monotonic() > deadline:
        print(json.dumps({"error": "gateways not ready with both workers in 240 s"})); sys.exit(0)
    time.sleep(0.5)
out = {"answers": {}}
for url in urls:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    texts = []
    for prompt in ("The capital of France is", "Count from one to five:"):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        texts.append(r.choices[0].text)
    out["answers"][url] = texts
    out["status"] = httpx.get(url + "/v1/status", timeout=5).json()
    out["metrics"] = httpx.get(url + "/metrics", timeout=5).text
print(json.dumps(out))
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture()
def namespaces() -> Iterator[dict[str, tuple[str, str, str]]]:
    """Two namespaces, side → (namespace, address, veth device), joined by a veth pair on
    10.231.<n>.0/24."""
    tag = os.getpid() % 200 + 20
    ns = {"a": (f"pdserve-a-{os.getpid()}", f"10.231.{tag}.1"),
          "b": (f"pdserve-b-{os.getpid()}", f"10.231.{tag}.2")}
    veth = {"a": f"pdva{os.getpid() % 100000}", "b": f"pdvb{os.getpid() % 100000}"}
    try:
        for side in ("a", "b"):
            _ip("netns", "add", ns[side][0])
        _ip("link", "add", veth["a"], "type", "veth", "peer", "name", veth["b"])
        for side in ("a", "b"):
            name, addr = ns[side]
            _ip("link", "set", veth[side], "netns", name)
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", veth[side])
            _ip("-n", name, "link", "set", veth[side], "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield {side: (*ns[side], veth[side]) for side in ("a", "b")}
    finally:
        for side in ("a", "b"):
            subprocess.run(["ip", "netns", "del", ns[side][0]], capture_output=True, timeout=10)


def _listening(namespace: str) -> list[str]:
    """``address:port`` of every listening TCP socket in ``namespace`` (IPv4 and IPv6)."""
    out = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        text = subprocess.run(["ip", "netns", "exec", namespace, "cat", table], capture_output=True,
                              text=True, timeout=10).stdout
        for line in text.splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state != "0A":  # LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            if width == 8:
                raw = bytes.fromhex(hex_addr)[::-1]
                addr = ".".join(str(b) for b in raw)
            else:
                words = [bytes.fromhex(hex_addr[i:i + 8])[::-1] for i in range(0, 32, 8)]
                raw = b"".join(words)
                addr = ":".join(raw[i:i + 2].hex() for i in range(0, 16, 2))
            out.append(f"{addr}:{int(hex_port, 16)}")
    return out


def test_two_namespaces_serve_through_both_gateways_with_kv_over_tcp(
        namespaces: dict[str, tuple[str, str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)  # the workers' own choice is what is tested
    keys = tmp_path / "keys"
    generate_keys(keys)
    (ns_a, addr_a, _), (ns_b, addr_b, _) = namespaces["a"], namespaces["b"]
    controls = f"tcp://{addr_a}:{CONTROL_PORT},tcp://{addr_b}:{CONTROL_PORT}"
    secure = ["--curve-keys", str(keys), "--log-format", "json"]
    env = {"PYTHONPATH": str(ROOT), "NO_PROXY": "*", "no_proxy": "*"}
    # UCX over TCP only (as between hosts without RDMA); its network device is the worker's own choice:
    # the interface holding its --host address (workers/setup.py default_transport_env), here the veth
    ucx = {side: {**env, "UCX_TLS": "tcp"} for side in namespaces}
    sups = {side: Supervisor(grace=10.0, command=("ip", "netns", "exec", ns, sys.executable, "-m",
                                                  "pdserve.cli"))
            for side, (ns, _, _) in namespaces.items()}
    try:
        for side, (_, addr, _) in namespaces.items():
            sups[side].start(f"gateway-{side}", ["gateway", "--host", addr, "--port", str(HTTP_PORT),
                                                 "--control-bind", f"tcp://{addr}:{CONTROL_PORT}", *secure],
                             str(tmp_path / f"gateway-{side}.log"), env=ucx[side])
        for side, role in (("a", "prefill"), ("b", "decode")):
            addr = namespaces[side][1]
            sups[side].start(role, [role, "--worker-id", WORKERS[role], "--model", MODEL, "--host", addr,
                                    "--gateway-control", controls, "--num-blocks", "128", "--device", "cpu",
                                    "--transfer-backend", "nixl", *secure],
                             str(tmp_path / f"{role}.log"), env=ucx[side])
        urls = f"http://{addr_a}:{HTTP_PORT},http://{addr_b}:{HTTP_PORT}"
        client = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-c", CLIENT, urls, MODEL,
                                 ",".join(WORKERS.values())], capture_output=True, text=True, timeout=400,
                                env={**os.environ, **env})
        dead = [d for sup in sups.values() for d in sup.dead()]
        assert client.returncode == 0 and not dead, (f"client: {client.stderr[-2000:]}; dead: {dead}; "
                                                     f"logs in {tmp_path}")
        got = json.loads(client.stdout.strip().splitlines()[-1])
        assert "error" not in got, f"{got['error']}; logs in {tmp_path}"
        answers = list(got["answers"].values())
        assert len(answers) == 2 and all(all(texts) for texts in answers)
        assert answers[0] == answers[1]  # greedy: the same through either gateway
        # served disaggregated: the KV went from the prefill worker (namespace a) to the decode worker (b)
        prefill_done = [line for line in got["metrics"].splitlines()
                        if line.startswith("pdserve_kv_transfer_bytes_total") and WORKERS["prefill"] in line]
        assert prefill_done and float(prefill_done[0].split()[-1]) > 0, prefill_done
        # every listening socket of either namespace is on that namespace's address
        for ns, addr in ((ns_a, addr_a), (ns_b, addr_b)):
            listening = _listening(ns)
            assert len(listening) >= 3, (ns, listening)  # HTTP, control, and the worker's sockets
            # (no 127.0.0.1, ::1, 0.0.0.0 or ::: the address of the namespace's veth only)
            assert all(sock.rsplit(":", 1)[0] == addr for sock in listening), listening
            print(ns, addr, sorted(listening))
        # every KV block free on both workers once the answers are in
        deadline = time.monotonic() + 30
        while True:
            status = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-c",
                                     "import httpx,sys; print(httpx.get(sys.argv[1], timeout=5).text)",
                                     f"http://{addr_a}:{HTTP_PORT}/metrics"], capture_output=True, text=True,
                                    timeout=60, env={**os.environ, **env}).stdout
            used = [float(line.split()[-1]) for line in status.splitlines()
                    if line.startswith("pdserve_kv_blocks_used{")]
            if used and all(u == 0 for u in used):
                break
            assert time.monotonic() < deadline, f"KV blocks still used: {used}"
            time.sleep(0.5)
    finally:
        for sup in sups.values():
            sup.stop_all()
