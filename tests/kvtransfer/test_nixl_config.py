"""TransferConfig.nixl_error_handling: reaches the NIXL UCX backend of both sides ("peer" by default),
a request moves bit-exact with either mode, and anything else is refused when the config is made."""

from __future__ import annotations

import pytest

from kvtransfer import TransferConfig, TransferStatus, get_transfer_backend
from tests.kvtransfer.helpers import assert_landed, config, make_kv, need_nixl, release_both

need_nixl()
pytestmark = pytest.mark.timeout(60)
SRC, DST = [3, 4, 5, 9], [0, 7, 8, 2]


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="'peer' or 'none'"):
        TransferConfig(worker_id="p", model_id="m", nixl_error_handling="off")


@pytest.mark.parametrize("mode", [None, "peer", "none"])
def test_mode_reaches_both_agents_and_data_lands(mode):
    kw = {} if mode is None else {"nixl_error_handling": mode}
    backend = get_transfer_backend("nixl")
    src, dst = make_kv(5), make_kv(None)
    tx = backend.sender(config("p0", "nixl", **kw), src)
    rx = backend.receiver(config("d0", "nixl", **kw), dst)
    try:
        for agent in (tx.transport.agent, rx.transport.agent):
            assert agent.get_backend_params("UCX")["ucx_error_handling_mode"] == (mode or "peer")
        tx.add_request(rx.expect("a", DST), SRC)
        tx.send_layers("a")
        assert rx.wait("a", 10) is TransferStatus.DONE, rx.reason("a")
        assert tx.wait("a", 10) is TransferStatus.DONE, tx.reason("a")
        assert_landed(src, SRC, dst, DST)
        release_both(tx, rx, "a", leaks=True)
    finally:
        tx.close()
        rx.close()
