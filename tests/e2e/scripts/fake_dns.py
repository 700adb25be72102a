"""Run a module with a few extra host names, as a DNS server would give them (for one process only).

    python fake_dns.py rdzv-server.ns.svc=127.0.0.1 -m node_agent --endpoint rdzv-server.ns.svc:PORT ...

Every name resolution of the process (socket.getaddrinfo: urllib, asyncio, aiohttp's threaded
resolver) sees NAME as ADDR, so a test can reach a server on loopback through a name that is not one
of the server's own, as agents reach one through a Kubernetes Service.
"""
import runpy
import socket
import sys

names = dict(item.split("=", 1) for item in sys.argv[1].split(","))
real_getaddrinfo = socket.getaddrinfo


def getaddrinfo(host, *args, **kwargs):
    return real_getaddrinfo(names.get(host, host), *args, **kwargs)


socket.getaddrinfo = getaddrinfo
try:                 # aiohttp uses aiodns where it is installed: use the resolver that asks socket
    import aiohttp.connector
    import aiohttp.resolver
    aiohttp.connector.DefaultResolver = aiohttp.resolver.ThreadedResolver
except ImportError:
    pass
if sys.argv[2] != "-m":
    raise SystemExit("usage: fake_dns.py NAME=ADDR[,NAME=ADDR] -m MODULE [ARGS...]")
sys.argv = [sys.argv[3], *sys.argv[4:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
