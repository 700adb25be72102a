"""The kernel's TCP_INFO as named fields (rdzv_server/tcp_info.py), read off the running kernel."""
from __future__ import annotations

import socket

import pytest

from rdzv_server import tcp_info


def test_the_running_kernel_lays_tcp_info_out_as_read():
    assert tcp_info.check() is None


def test_the_fields_of_a_loopback_connection():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    waiting = [socket.create_connection(listener.getsockname()) for _ in range(2)]
    try:
        info = tcp_info.read(listener)
        assert info is not None and info.unacked == 2          # two connections not accepted yet
        accepted, _ = listener.accept()
        waiting[0].sendall(b"x")
        assert accepted.recv(1) == b"x"
        mine, theirs = tcp_info.read(waiting[0]), tcp_info.read(accepted)
        assert mine is not None and theirs is not None
        assert 0.0 <= mine.last_data_sent_s < 5.0 and 0.0 <= theirs.last_data_recv_s < 5.0
        accepted.close()
    finally:
        for s in waiting:
            s.close()
        listener.close()
    assert tcp_info.read(listener) is None and tcp_info.read(None) is None and tcp_info.of(None) is None


def test_a_kernel_that_reads_otherwise_turns_every_read_off(monkeypatch):
    monkeypatch.setattr(tcp_info, "read", lambda sock: tcp_info.TcpInfo(0, 0.0, 0.0, 0.0))
    monkeypatch.setattr(tcp_info, "_enabled", True)
    problem = tcp_info.check()
    assert problem is not None and "an accept queue of 1 reads as 0" in problem
    assert tcp_info._enabled is False


@pytest.fixture(autouse=True)
def _restore():
    yield
    tcp_info._enabled = hasattr(socket, "TCP_INFO")
