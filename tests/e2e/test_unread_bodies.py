"""A request the server answers before its body is in (a route that reads none, a refusal, a body past the cap) has
its connection closed once answered (rdzv_server/web/app.py, error_middleware): aiohttp read such a body on for
10 s after the answer ("lingering"), so a client streaming one endlessly had the server swallow ~330 MiB/s of it on
its one loop. Measured in bytes, not time: the server takes no more than the cap and the sockets' buffers."""
from __future__ import annotations

import contextlib
import select
import socket

import pytest

pytestmark = pytest.mark.e2e
PIECE = b"10000\r\n" + b"\x90" * 0x10000 + b"\r\n"      # one chunk of 64 KiB
BODY_LIMIT = 64 << 20      # the 1 MiB cap and loopback's socket buffers (a few MiB); lingering took far more
GIVE_UP = 512 << 20


@pytest.mark.parametrize("head, status", [
    (b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", b"200"),
    (b"POST /v1/jobs/j/poll HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n", b"413"),                               # refused past 1 MiB
    (b"POST /v1/jobs/j/poll HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n", b"415"),
    (b"POST /v1/jobs/j/poll HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
     b"Content-Length: 1000000000\r\n\r\n", b"413"),
])
def test_a_body_streamed_on_after_the_answer_is_not_read(cluster, head: bytes, status: bytes) -> None:
    port = cluster.start_server("--state-dir", "none")
    chunked = b"chunked" in head
    answer, sent = b"", 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        if select.select([s], [], [], 5)[0]:     # answered on its head alone (all but a body past the cap)
            answer = s.recv(65536)
        with contextlib.suppress(ConnectionError):     # reset: closed with what was sent unread, as it should be
            while sent < GIVE_UP:
                s.sendall(PIECE if chunked else PIECE[7:-2])
                sent += len(PIECE)
                if select.select([s], [], [], 0)[0]:
                    got = s.recv(65536)
                    if not got:
                        break                 # closed by the server
                    answer += got
    # The answer itself may be lost to the reset where it came after a MiB of body (it is seen there on most runs).
    assert answer.split(b" ", 2)[1:2] == [status] or (not answer and status == b"413"), answer[:200]
    assert sent < BODY_LIMIT, f"{sent >> 20} MiB taken before the connection was closed"


def test_a_client_sending_its_body_after_an_early_answer_reads_it_and_keeps_its_connection(cluster) -> None:
    """A body sent in pieces, answered on its head for a reason of its own (a 415 here): the client sends the rest
    (http.client and the like send it all before they read) and reads the answer, then asks again on the same
    connection. Closed at once on the answer (the first fix of lingering), it got a broken pipe or a reset."""
    port = cluster.start_server("--state-dir", "none")
    body = b"z" * 300_000
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/jobs/j/poll HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        answer = response(s)
        assert answer.startswith(b"HTTP/1.1 415 "), answer[:200]
        s.sendall(body)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        again = response(s)
    assert again.startswith(b"HTTP/1.1 200 "), again[:200]


def response(s: socket.socket) -> bytes:
    """One whole response (head and Content-Length body) read off `s`; b"" once closed (or reset) before it."""
    got = b""
    with contextlib.suppress(ConnectionError):
        while b"\r\n\r\n" not in got and (piece := s.recv(65536)):
            got += piece
        head = got.split(b"\r\n\r\n", 1)[0].lower()
        length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0]) if b"content-length:" in head else 0
        while len(got) < len(head) + 4 + length and (piece := s.recv(65536)):
            got += piece
    return got
