"""The authenticated rendezvous store: clients that prove the cluster token share one key-value store (the calls
gloo's rendezvous makes), a wrong token or a stranger speaking another protocol gets nothing, and a real gloo group
meets through it."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
from datetime import timedelta

import pytest

from nanocp.comm.auth_store import AuthStore, AuthStoreServer, StoreError
from nanocp.comm.metadata_channel import MetadataAuthError

TOKEN = "store-test-token"


@pytest.fixture
def server():
    s = AuthStoreServer(TOKEN, host="127.0.0.1")
    yield s
    s.close()


def test_clients_with_the_token_share_one_store(server):
    a, b = AuthStore(("127.0.0.1", server.port), TOKEN), AuthStore(("127.0.0.1", server.port), TOKEN)
    try:
        threading.Timer(0.1, a.set, args=("addr/1", b"10.0.0.2:1234")).start()
        assert b.get("addr/1") == b"10.0.0.2:1234"  # blocks until the other rank has set it
        assert a.add("count", 2) == 2 and b.add("count", 3) == 5
        assert a.check(["addr/1", "count"]) and not a.check(["missing"])
        assert a.compare_set("cas", "", "first") == b"first"
        assert b.compare_set("cas", "wrong", "second") == b"first"
        assert b.compare_set("cas", "first", "second") == b"second"
        assert a.num_keys() == 3 and a.delete_key("cas") and not a.delete_key("cas")
        with pytest.raises(StoreError, match="timed out"):
            a.wait(["never"], timedelta(milliseconds=100))
    finally:
        a.close()
        b.close()


def test_a_wrong_token_or_another_protocol_gets_nothing(server):
    good = AuthStore(("127.0.0.1", server.port), TOKEN)
    good.set("secret", b"rendezvous data")
    with pytest.raises(MetadataAuthError):
        AuthStore(("127.0.0.1", server.port), "not-the-token", timeout_s=5)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:  # a TCPStore-style client
        raw.recv(64)  # the server's challenge
        raw.sendall(b"\x00" * 64)  # no valid answer to it
        assert raw.recv(64) == b""  # closed, nothing read
    assert server.rejected == 2
    assert good.get("secret") == b"rendezvous data"
    good.close()


def _rank(rank: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    store = AuthStore(("127.0.0.1", port), TOKEN)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    out.put((rank, float(t)))
    dist.destroy_process_group()


def test_a_gloo_group_meets_through_the_store(server):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, server.port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert results == [(0, 3.0), (1, 3.0)]
