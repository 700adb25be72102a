"""Hosts as Linux network namespaces, joined by one switch, with faults injected on their links.

Layout of one `Network` (every name carries the owner's pid and a random token, so parallel test
workers and other users never collide, and a sweep can tell an abandoned network from a live one):

    rdzvt-PID-TOKEN-sw       the switch: a bridge `br0` and one port per host (`p-HOST`)
    rdzvt-PID-TOKEN-HOST     one per host: `lo` and `eth0` (the other end of `p-HOST`), one address
                             in a random 10.X.Y.0/24

Nothing is created in the root namespace, so interface names only need to be unique per network.
Faults:
- `cut(host)`: the switch port goes down. The host's `eth0` loses carrier; its route stays, so what
  it sends is dropped silently, with no FIN or RST either way (a pulled cable, a dead switch port).
- `partition(a, b)`: an nftables table in both hosts drops what comes from the other: both sides
  send, nothing arrives, no error is returned to either (a firewall or routing black hole).
- `one_way(src, dst)`: an nftables (bridge) table on the switch drops what `src` sends to `dst`, not
  the way back: one-way loss in the network, no error to either side.
Namespaces, veths, the bridge and the nftables tables all go with `close()`, which first kills every
process still inside (`ip netns pids`), whoever started it.
"""
from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import threading
import time

import psutil

PREFIX = "rdzvt-"
NETNS_DIR = "/var/run/netns"
CLONE_NEWNET = 0x40000000
NFT_TABLE = "rdzvt"


class NetnsError(RuntimeError):
    pass


def ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def nft(ns: str, script: str) -> None:
    done = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=script, capture_output=True,
                          text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsError(f"nft in {ns}: {done.stderr.strip()}\n{script}")


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here (then the tests skip), or None when they can."""
    if os.geteuid() != 0:
        return f"network namespaces need root (this runs as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
    except NetnsError as exc:
        return f"cannot create a network namespace: {exc}"
    ip("netns", "del", probe, check=False)
    return None


def tool_missing() -> str | None:
    """The fault tools the tests need; `make netns-tools` installs what is missing."""
    if shutil.which("nft") is None:
        return "nft (Debian package nftables) is not installed: run `make netns-tools`"
    return None


def kill_namespace_processes(ns: str, timeout: float = 10.0) -> None:
    """SIGKILL every process inside a namespace (agents, workers, orphans alike) until none is left.
    A dead process leaves the list (a zombie has no namespace), so nobody else's child is reaped
    here: its parent still gets its exit status."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [int(p) for p in ip("netns", "pids", ns, check=False).split()]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)    # SIGKILL is not synchronous; look again


def delete_namespace(ns: str) -> None:
    kill_namespace_processes(ns)
    ip("netns", "del", ns, check=False)


def sweep_abandoned() -> list[str]:
    """Delete networks left behind by test processes that died without cleaning up (owner pid gone)."""
    removed = []
    names = os.listdir(NETNS_DIR) if os.path.isdir(NETNS_DIR) else []
    for ns in names:
        if not ns.startswith(PREFIX):
            continue
        owner = ns[len(PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not psutil.pid_exists(int(owner)):
            delete_namespace(ns)
            removed.append(ns)
    return removed


class Network:
    """A switch and some hosts. Use as a context manager, or call `close()` in a finalizer."""

    def __init__(self, hosts: list[str]) -> None:
        self.name = f"{PREFIX}{os.getpid()}-{random.randrange(16 ** 6):06x}"
        # Hosts live only on this network's own switch, so subnets could repeat; a random one keeps
        # logs of parallel runs apart.
        self.subnet = f"10.{random.randrange(1, 255)}.{random.randrange(0, 256)}"
        self.hosts = list(hosts)
        self._addrs = {h: f"{self.subnet}.{i + 1}" for i, h in enumerate(hosts)}
        self._made: list[str] = []
        self._partitions: dict[str, set[str]] = {h: set() for h in hosts}
        self._one_way: set[tuple[str, str]] = set()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def ns(self, host: str) -> str:
        return f"{self.name}-{host}"

    @property
    def switch(self) -> str:
        return f"{self.name}-sw"

    def addr(self, host: str) -> str:
        return self._addrs[host]

    def _add_ns(self, ns: str) -> None:
        ip("netns", "add", ns)
        self._made.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_ns(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
        ip("-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            ns = self.ns(host)
            self._add_ns(ns)
            port = self._port(host)
            ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")

    @staticmethod
    def _port(host: str) -> str:
        port = f"p-{host}"
        if len(port) > 15:
            raise ValueError(f"host name {host!r} too long for an interface name")
        return port

    # ------------------------------------------------------------------------------------- faults

    def cut(self, host: str) -> None:
        """The host's switch port goes down: silent loss both ways, no FIN, no error to senders."""
        ip("-n", self.switch, "link", "set", self._port(host), "down")

    def reconnect(self, host: str, timeout: float = 5.0) -> None:
        """The port comes back up; returns once both ends report carrier. The kernel applies carrier
        changes a moment later (its link watch runs up to once a second), and until then the
        host's eth0 still drops what it sends."""
        ip("-n", self.switch, "link", "set", self._port(host), "up")
        deadline = time.monotonic() + timeout
        while not (_carrier(self.switch, self._port(host)) and _carrier(self.ns(host), "eth0")):
            if time.monotonic() > deadline:
                raise NetnsError(f"{host}: link still down {timeout:g}s after its port came up")
            time.sleep(0.02)

    def partition(self, a: str, b: str) -> None:
        """Drop everything between two hosts (both directions, at each receiver), nothing else."""
        self._partitions[a].add(b)
        self._partitions[b].add(a)
        self._apply_partitions(a)
        self._apply_partitions(b)

    def heal(self, a: str, b: str) -> None:
        self._partitions[a].discard(b)
        self._partitions[b].discard(a)
        self._apply_partitions(a)
        self._apply_partitions(b)

    def _apply_partitions(self, host: str) -> None:
        missing = tool_missing()
        if missing:
            raise NetnsError(missing)
        peers = sorted(self.addr(p) for p in self._partitions[host])
        rules = "".join(f"\t\tip saddr {addr} drop\n" for addr in peers)
        # Dropped on input, not output: a local sender whose packet is dropped on output gets EPERM,
        # which a real partition never gives.
        nft(self.ns(host), f"table inet {NFT_TABLE}\ndelete table inet {NFT_TABLE}\n"
                           f"table inet {NFT_TABLE} {{\n\tchain input {{\n"
                           f"\t\ttype filter hook input priority 0; policy accept;\n{rules}\t}}\n}}\n")

    def one_way(self, src: str, dst: str) -> None:
        """Drop at the switch what `src` sends to `dst` (that direction only)."""
        self._one_way.add((src, dst))
        self._apply_one_way()

    def heal_one_way(self, src: str, dst: str) -> None:
        self._one_way.discard((src, dst))
        self._apply_one_way()

    def _apply_one_way(self) -> None:
        missing = tool_missing()
        if missing:
            raise NetnsError(missing)
        rules = "".join(f"\t\tip saddr {self.addr(s)} ip daddr {self.addr(d)} drop\n" for s, d in sorted(self._one_way))
        nft(self.switch, f"table bridge {NFT_TABLE}\ndelete table bridge {NFT_TABLE}\n"
                         f"table bridge {NFT_TABLE} {{\n\tchain forward {{\n"
                         f"\t\ttype filter hook forward priority 0; policy accept;\n{rules}\t}}\n}}\n")

    # ---------------------------------------------------------------------------- talking inside

    def socket(self, host: str) -> socket.socket:
        """A TCP socket that lives in the host's namespace, usable from any thread of this process."""
        return socket_in(self.ns(host))

    def exec_argv(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def pids(self, host: str) -> list[int]:
        return [int(p) for p in ip("netns", "pids", self.ns(host), check=False).split()]

    def close(self) -> None:
        """Kill everything inside, then delete the hosts and the switch (veths go with them)."""
        for ns in reversed(self._made):
            delete_namespace(ns)
        self._made.clear()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _carrier(ns: str, dev: str) -> bool:
    return " state UP " in ip("-n", ns, "-o", "link", "show", "dev", dev)


_libc = ctypes.CDLL(None, use_errno=True)


def socket_in(ns: str) -> socket.socket:
    """Create a socket inside namespace `ns`. A socket belongs to the namespace of the thread that
    made it, and setns() on a network namespace changes only the calling thread, so a short-lived
    thread enters the namespace, makes the socket, and ends."""
    out: dict[str, object] = {}

    def make() -> None:
        try:
            with open(os.path.join(NETNS_DIR, ns)) as f:
                if _libc.setns(f.fileno(), CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({ns}): {os.strerror(err)}")
            out["sock"] = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        except BaseException as exc:   # handed to the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=make, name=f"setns-{ns}")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    sock = out["sock"]
    assert isinstance(sock, socket.socket)
    return sock

