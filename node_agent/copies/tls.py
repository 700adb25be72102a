"""TLS for peer copies: where the server uses TLS, a snapshot (the model's weights) must not cross the network in
the clear either. Each agent shows a certificate (--tls-cert/--tls-key) signed by the CA the others trust
(--tls-ca), both ways: only a holder of such a certificate and the node's token can push, fetch or drop. Peers are
reached by address, so a certificate's name is not checked, its signature is."""
from __future__ import annotations

import ssl
from dataclasses import dataclass


@dataclass(frozen=True)
class CopyTls:
    listen: ssl.SSLContext       # the agent's TLS listener for copies
    connect: ssl.SSLContext      # its pushes, fetches and drops


def copy_tls(cert: str, key: str, ca: str) -> CopyTls:
    """Both contexts from the agent's certificate, key and CA (ssl.SSLError / OSError: the files are bad)."""
    listen = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
    listen.verify_mode = ssl.CERT_REQUIRED
    # TLS 1.2 renegotiation refused: a certificate holder renegotiating in a loop costs the agent a handshake's
    # CPU each time (OpenSSL 3 refuses a client's by default; 1.1.1, which some Pythons still link, allows it).
    listen.options |= ssl.OP_NO_RENEGOTIATION
    listen.load_cert_chain(cert, key)
    connect = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    connect.check_hostname = False       # peers are addresses; the CA's signature is what is checked
    connect.load_cert_chain(cert, key)
    return CopyTls(listen, connect)
