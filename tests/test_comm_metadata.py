"""Metadata channel: frame validation, fault injection, resync, authentication, cross-process delivery."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanocp.comm import (
    Fault,
    FaultySender,
    FrameCheck,
    MetadataAuthError,
    MetadataCapacityError,
    MetadataChannelError,
    MetadataError,
    MetadataTimeout,
    RdmaMetadataReceiver,
    RdmaMetadataSender,
    ShmMetadataReceiver,
    ShmMetadataSender,
    TcpMetadataReceiver,
    TcpMetadataSender,
    _shm,
    auth,
    rdma_available,
)
from nanocp.comm.launch import run_processes
from nanocp.comm.metadata_channel import HEADER_SIZE, decode_header, encode_header

TOKEN = "cluster-token-for-tests"
CAPACITY = 4096


def open_channel(backend: str, instance_id: int = 7, capacity: int = CAPACITY):
    if backend == "shm":
        receiver = ShmMetadataReceiver(instance_id, capacity)
        return receiver, ShmMetadataSender(receiver.info)
    receiver = TcpMetadataReceiver(instance_id, capacity, TOKEN)
    return receiver, TcpMetadataSender(receiver.address, TOKEN, instance_id)


@pytest.fixture(params=["shm", "tcp"])
def channel(request):
    receiver, sender = open_channel(request.param)
    yield receiver, sender
    sender.close()
    receiver.close()


def table(seq: int, size: int | None = None) -> bytes:
    """A fresh random table (random size unless given)."""
    return os.urandom(size if size is not None else 1 + (seq * 7919) % (CAPACITY - 1))


# ---- codec ----------------------------------------------------------------------------------------------
def test_header_round_trip_and_each_field_check():
    payload = os.urandom(100)
    raw = encode_header(42, 3, payload)
    assert len(raw) == HEADER_SIZE
    head = decode_header(raw, CAPACITY, 3)
    assert (head.seq, head.payload_len, head.instance_id) == (42, 100, 3)

    def damaged(offset: int, value: bytes) -> bytes:
        return raw[:offset] + value + raw[offset + len(value) :]

    cases = {
        FrameCheck.MAGIC: damaged(0, b"XXXX"),
        FrameCheck.VERSION: damaged(4, struct.pack("<H", 9)),
        FrameCheck.HEADER: damaged(8, struct.pack("<Q", 43)),  # seq changed, header crc not
    }
    for check, bad in cases.items():
        with pytest.raises(MetadataError) as info:
            decode_header(bad, CAPACITY, 3)
        assert info.value.check is check
    with pytest.raises(MetadataError) as info:
        decode_header(encode_header(1, 3, os.urandom(200)), 100, 3)
    assert info.value.check is FrameCheck.LENGTH
    with pytest.raises(MetadataError) as info:
        decode_header(raw, CAPACITY, 4)
    assert info.value.check is FrameCheck.INSTANCE


# ---- delivery -------------------------------------------------------------------------------------------
def test_tables_arrive_intact_in_order(channel):
    receiver, sender = channel
    for seq, size in enumerate([1, 4096, 0, 333, 2048], start=1):
        payload = table(seq, size)
        sender.push(seq, payload)
        assert bytes(receiver.wait_table(seq, timeout_s=5)) == payload
        assert receiver.last_seq == seq


def test_sender_checks_capacity_and_sequence(channel):
    receiver, sender = channel
    with pytest.raises(MetadataCapacityError):
        sender.push(1, bytes(CAPACITY + 1))
    sender.push(5, b"abc")
    with pytest.raises(ValueError, match="increase"):
        sender.push(5, b"abc")
    with pytest.raises(ValueError, match="increase"):
        sender.push(4, b"abc")
    assert bytes(receiver.wait_table(1, timeout_s=5)) == b"abc" and receiver.last_seq == 5
    with pytest.raises(ValueError, match="already delivered"):
        receiver.wait_table(5, timeout_s=0.01)


def test_wait_without_push_times_out(channel):
    receiver, _ = channel
    start = time.monotonic()
    with pytest.raises(MetadataTimeout, match="seq >= 1"):
        receiver.wait_table(1, timeout_s=0.05)
    assert time.monotonic() - start < 2.0


# ---- faults ---------------------------------------------------------------------------------------------
def expect_rejected(receiver, seq: int, check: FrameCheck | None = None) -> None:
    with pytest.raises(MetadataError) as info:
        receiver.wait_table(seq, timeout_s=5)
    if check is not None:
        assert info.value.check is check


def test_every_fault_is_detected_and_a_fresh_push_resynchronises(channel):
    receiver, sender = channel
    faulty = FaultySender(sender, seed=11)
    faulty.push(1, table(1))
    receiver.wait_table(1, timeout_s=5)

    faulty.push(2, table(2), Fault.DROP)  # lost: the receiver times out ...
    with pytest.raises(MetadataTimeout):
        receiver.wait_table(2, timeout_s=0.05)
    fresh = table(3)
    faulty.push(3, fresh)  # ... and the resend with the next seq resynchronises
    assert bytes(receiver.wait_table(2, timeout_s=5)) == fresh and receiver.last_seq == 3

    faulty.push(4, table(4), Fault.CORRUPT)
    expect_rejected(receiver, 4, FrameCheck.CHECKSUM)
    faulty.push(5, table(5), Fault.CORRUPT, at=9)  # a header byte
    expect_rejected(receiver, 4, FrameCheck.HEADER)
    faulty.push(6, table(6), Fault.TEAR)
    expect_rejected(receiver, 4, FrameCheck.CHECKSUM)
    faulty.duplicate()  # the torn frame 6, intact, arriving late: never seen, so accepted
    assert receiver.wait_table(4, timeout_s=5) is not None and receiver.last_seq == 6
    faulty.duplicate()  # and again: now it is a duplicate
    expect_rejected(receiver, 7, FrameCheck.DUPLICATE)
    faulty.replay(3)
    expect_rejected(receiver, 7, FrameCheck.STALE)

    fresh = table(7)
    faulty.push(7, fresh)
    assert bytes(receiver.wait_table(7, timeout_s=5)) == fresh and receiver.last_seq == 7


@settings(max_examples=30, deadline=None)
@given(size=st.integers(1, 300), flip=st.integers(0, 10_000), seed=st.integers(0, 2**16))
def test_any_single_byte_flip_is_rejected(size, flip, seed):
    receiver, sender = open_channel("shm", capacity=512)
    try:
        faulty = FaultySender(sender, seed=seed)
        faulty.push(1, os.urandom(size), Fault.CORRUPT, at=flip % (HEADER_SIZE + size))
        with pytest.raises(MetadataError):
            receiver.wait_table(1, timeout_s=5)
        good = os.urandom(size)
        faulty.push(2, good)
        assert bytes(receiver.wait_table(1, timeout_s=5)) == good
    finally:
        sender.close()
        receiver.close()


def test_tear_of_any_length_is_rejected():
    receiver, sender = open_channel("shm", capacity=256)
    faulty = FaultySender(sender)
    for seq, written in enumerate(range(0, 200, 13), start=1):
        faulty.push(seq, os.urandom(200), Fault.TEAR, at=written)
        expect_rejected(receiver, seq, FrameCheck.CHECKSUM)
    with pytest.raises(ValueError, match="fewer"):
        faulty.push(100, os.urandom(10), Fault.TEAR, at=10)
    sender.close()
    receiver.close()


# ---- shared memory specifics ----------------------------------------------------------------------------
def test_shm_close_unlinks_the_context_buffer():
    receiver = ShmMetadataReceiver(1, 64)
    name = receiver.info.name
    assert _shm.list_prefix(name) == [name]
    receiver.close()
    assert _shm.list_prefix(name) == []


def sender_process(rank: int, world: int, info, count: int) -> int:
    sender = ShmMetadataSender(info)
    for seq in range(1, count + 1):
        sender.push(seq, expected_table(seq))
    sender.close()
    return count


def expected_table(seq: int) -> bytes:
    return (seq.to_bytes(8, "little") * 64)[: 8 + (seq * 37) % 500]


def test_shm_receiver_with_writer_in_another_process():
    """A writer racing the reader: every table returned is exactly the one its seq names, seqs increase,
    and the last one always arrives."""
    receiver = ShmMetadataReceiver(0, 512)
    count, received = 300, []
    done = threading.Event()

    def read():
        while receiver.last_seq < count:
            try:
                payload = bytes(receiver.wait_table(receiver.last_seq + 1, timeout_s=60))
            except MetadataError:
                continue  # a torn read is allowed to be rejected, never to be returned
            received.append((receiver.last_seq, payload))
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    run_processes(sender_process, 1, args=(receiver.info, count), timeout_s=120)
    assert done.wait(60)
    receiver.close()
    seqs = [s for s, _ in received]
    assert seqs[-1] == count and seqs == sorted(set(seqs))
    assert all(payload == expected_table(seq) for seq, payload in received)


# ---- tcp specifics --------------------------------------------------------------------------------------
def test_tcp_binds_loopback_and_rejects_a_wrong_token():
    receiver = TcpMetadataReceiver(3, 128, TOKEN)
    assert receiver.address[0] == "127.0.0.1"
    with pytest.raises(MetadataAuthError):
        TcpMetadataSender(receiver.address, "not-the-token", 3)
    deadline = time.monotonic() + 5
    while receiver.rejected < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert receiver.rejected == 1
    with pytest.raises(MetadataChannelError, match="instance 3"):
        TcpMetadataSender(receiver.address, TOKEN, 4)
    sender = TcpMetadataSender(receiver.address, TOKEN, 3)  # the server keeps serving
    sender.push(1, b"ok")
    assert bytes(receiver.wait_table(1, timeout_s=5)) == b"ok"
    sender.close()
    receiver.close()


def test_tcp_client_refuses_a_server_without_the_token():
    """A fake server that does not know the token cannot make the sender talk to it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def impostor():
        conn, _ = listener.accept()
        with conn:
            auth.server_handshake(conn, b"some-other-token")

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    with pytest.raises(MetadataAuthError):
        TcpMetadataSender(listener.getsockname()[:2], TOKEN, 0)
    thread.join(5)
    listener.close()


def test_tcp_oversized_frame_closes_only_that_connection():
    receiver = TcpMetadataReceiver(2, 64, TOKEN)
    raw = socket.create_connection(receiver.address, timeout=5)
    auth.client_handshake(raw, TOKEN.encode())
    auth.recv_message(raw, 64)
    raw.sendall(struct.pack("<I", HEADER_SIZE + 65) + bytes(HEADER_SIZE + 65))
    try:
        closed = raw.recv(1) == b""  # closed by the instance (FIN) ...
    except ConnectionResetError:
        closed = True  # ... or reset because our bytes were left unread
    assert closed
    raw.close()
    sender = TcpMetadataSender(receiver.address, TOKEN, 2)
    sender.push(1, b"still fine")
    assert bytes(receiver.wait_table(1, timeout_s=5)) == b"still fine"
    sender.close()
    receiver.close()


# ---- rdma -----------------------------------------------------------------------------------------------
RDMA_OK, RDMA_REASON = rdma_available()


@pytest.mark.skipif(not RDMA_OK, reason=RDMA_REASON)
def test_rdma_write_with_imm_delivers_validated_tables():
    receiver = RdmaMetadataReceiver(5, CAPACITY, TOKEN)
    with pytest.raises(MetadataAuthError):
        RdmaMetadataSender(receiver.address, "wrong", 5)
    sender = RdmaMetadataSender(receiver.address, TOKEN, 5)
    faulty = FaultySender(sender)
    for seq in range(1, 6):
        payload = table(seq)
        faulty.push(seq, payload)
        assert bytes(receiver.wait_table(seq, timeout_s=10)) == payload
    faulty.push(6, table(6), Fault.CORRUPT)
    expect_rejected(receiver, 6, FrameCheck.CHECKSUM)
    sender.close()
    receiver.close()


def test_rdma_capability_check_explains_itself():
    ok, reason = rdma_available()
    assert isinstance(ok, bool) and reason
    if not ok:
        with pytest.raises(MetadataChannelError, match="pyverbs|RDMA"):
            RdmaMetadataReceiver(0, 64, TOKEN)
