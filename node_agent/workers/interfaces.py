"""Which network interface the workers' gloo should use, when the host's own name would mislead it.
gloo advertises the address the host name resolves to unless GLOO_SOCKET_IFNAME is set; on Debian and Ubuntu
that is 127.0.1.1, loopback, and the job fails. When unset, the name resolves to loopback and this node's
address is not, the agent sets it to that address's interface and says so (NCCL's twin: docs/deploy.md).
"""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping

_SIOCGIFADDR = 0x8915      # Linux: an interface's IPv4 address


def interface_of(addr: str) -> str | None:
    """The name of the local interface with IPv4 address `addr` (None when none has it)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue                       # no IPv4 address on this interface
            if socket.inet_ntoa(raw[20:24]) == addr:
                return name
    return None


def _loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def gloo_interface(addr: str, environ: Mapping[str, str], hostname: str | None = None) -> tuple[str, str] | None:
    """(interface, why) when the workers need GLOO_SOCKET_IFNAME set for them, else None."""
    if environ.get("GLOO_SOCKET_IFNAME") or _loopback(addr):
        return None
    name = hostname or socket.gethostname()
    try:
        resolved = socket.gethostbyname(name)
    except OSError:
        return None
    if not _loopback(resolved):
        return None
    interface = interface_of(addr)
    if interface is None:
        return None
    return interface, (f"host name {name} resolves to {resolved} (loopback), which gloo would advertise to "
                       f"the other hosts: setting GLOO_SOCKET_IFNAME={interface} for the workers (the interface "
                       f"of {addr}); set GLOO_SOCKET_IFNAME yourself to choose another")
