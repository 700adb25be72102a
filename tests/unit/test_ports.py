"""The store's port is taken below the kernel's ephemeral range, where outgoing connections cannot take it
between the offer and the store's bind."""
from __future__ import annotations

import socket

from node_agent.client.ports import LOWEST, ephemeral_start, free_port


def test_the_port_offered_lies_below_the_ephemeral_range_and_can_be_bound():
    start = ephemeral_start()
    for _ in range(20):
        port = free_port("127.0.0.1")
        assert LOWEST <= port < start
        with socket.socket() as s:
            s.bind(("", port))     # free, as promised


def test_where_the_range_leaves_no_room_the_kernel_picks():
    port = free_port(below=LOWEST + 10)
    assert port >= ephemeral_start()


def test_the_range_is_read_from_the_kernel_and_a_bad_file_falls_back(tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_text("20000\t60999\n")
    bad.write_text("junk\n")
    assert ephemeral_start(str(good)) == 20000
    assert ephemeral_start(str(bad)) == 32768
    assert ephemeral_start(str(tmp_path / "absent")) == 32768

