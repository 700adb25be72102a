"""`rdzv-server`'s etcd flags: `--store etcd://...`, TLS and auth spelt as etcdctl spells them
(`--cacert`, `--cert`, `--key`, `--user`, `--password`, with an `--etcd-` prefix), the deployment's
key prefix, and the replica's own address and lease for the election."""
from __future__ import annotations

import argparse
import os
import ssl

from rdzv_server.store.etcd.client import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_TXN_OPS,
    EtcdSettings,
    parse_store_url,
    request_timeout_s,
)
from rdzv_server.store.etcd.election import DEFAULT_TTL_S
from rdzv_server.store.etcd.store import MIN_TXN_OPS

PASSWORD_ENV = "RDZV_ETCD_PASSWORD"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replicas on etcd (--store etcd://...)")
    g.add_argument("--store", metavar="URL",
                   help="etcd://HOST:PORT[,HOST:PORT...]: keep the state in etcd and run as one of several "
                        "replicas (one leads, the others stand by); instead of --state-dir")
    g.add_argument("--etcd-prefix", default="/rdzv/", metavar="P",
                   help="key prefix of this deployment in etcd; deployments sharing an etcd each need their own "
                        "(default /rdzv/)")
    g.add_argument("--etcd-cacert", metavar="F", help="CA certificates (PEM) of etcd's TLS certificates; implies https")
    g.add_argument("--etcd-cert", metavar="F", help="client certificate (PEM) for etcd's TLS client authentication")
    g.add_argument("--etcd-key", metavar="F", help="the private key of --etcd-cert (PEM)")
    g.add_argument("--etcd-user", metavar="USER[:PASSWORD]", help="etcd user (etcd's authentication)")
    g.add_argument("--etcd-password", metavar="PASSWORD",
                   help=f"the user's password (or ${PASSWORD_ENV}, or --etcd-password-file; a password given on "
                        "the command line is visible to other users of the machine)")
    g.add_argument("--etcd-password-file", metavar="F", help="file holding the etcd user's password")
    g.add_argument("--etcd-max-txn-ops", type=int, default=DEFAULT_MAX_TXN_OPS, metavar="N",
                   help=f"etcd's --max-txn-ops (default {DEFAULT_MAX_TXN_OPS}): commits are split to fit")
    g.add_argument("--etcd-max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                   help=f"etcd's --max-request-bytes (default {DEFAULT_MAX_REQUEST_BYTES})")
    g.add_argument("--advertise-url", metavar="URL",
                   help="this replica's URL as agents reach it, told to them by the standbys (default: "
                        "http(s)://THIS-HOST:PORT)")
    g.add_argument("--leader-ttl", type=int, default=DEFAULT_TTL_S, metavar="S",
                   help="the leader's etcd lease: a leader that cannot renew it steps down, and a stopped or "
                        f"cut-off leader is replaced, after this long (default {DEFAULT_TTL_S}; at least 2)")


def settings_from(args: argparse.Namespace) -> EtcdSettings:
    """EtcdSettings from the flags; ValueError (one line, naming the flag) when they cannot work."""
    tls = bool(args.etcd_cacert or args.etcd_cert)
    try:
        endpoints = parse_store_url(args.store, tls)
    except ValueError as exc:
        raise ValueError(f"--store: {exc}") from None
    if bool(args.etcd_cert) != bool(args.etcd_key):
        raise ValueError("--etcd-cert and --etcd-key go together")
    for flag, path in (("--etcd-cacert", args.etcd_cacert), ("--etcd-cert", args.etcd_cert),
                       ("--etcd-key", args.etcd_key)):
        if path and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    if tls:
        try:
            context = ssl.create_default_context(cafile=args.etcd_cacert)
            if args.etcd_cert:
                context.load_cert_chain(args.etcd_cert, args.etcd_key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot use the etcd TLS files: {getattr(exc, 'strerror', None) or exc}") from None
    user, password = args.etcd_user, args.etcd_password
    if user and ":" in user:
        user, _, password = user.partition(":")
    if args.etcd_password_file:
        try:
            with open(args.etcd_password_file) as f:
                password = f.read().strip()
        except OSError as exc:
            raise ValueError(f"--etcd-password-file {args.etcd_password_file}: {exc.strerror or exc}") from None
    password = password or os.environ.get(PASSWORD_ENV) or None
    if password and not user:
        raise ValueError("an etcd password needs --etcd-user")
    prefix = args.etcd_prefix
    if not prefix or not prefix.isprintable() or not prefix.isascii():
        raise ValueError(f"--etcd-prefix must be printable ASCII, got {prefix!r}")
    _check_limits(args)
    # a commit waits on a member that does not answer no longer than a renewal of the lease does
    return EtcdSettings(endpoints, prefix if prefix.endswith("/") else prefix + "/", args.etcd_cacert,
                        args.etcd_cert, args.etcd_key, user or None, password,
                        timeout_s=request_timeout_s(args.leader_ttl),
                        max_txn_ops=args.etcd_max_txn_ops, max_request_bytes=args.etcd_max_request_bytes)


def _check_limits(args: argparse.Namespace) -> None:
    if args.etcd_max_txn_ops < MIN_TXN_OPS:
        raise ValueError(f"--etcd-max-txn-ops must be >= {MIN_TXN_OPS} (one job's commit), got {args.etcd_max_txn_ops}")
    if args.etcd_max_request_bytes < 256 * 1024:
        raise ValueError(f"--etcd-max-request-bytes must be >= 262144, got {args.etcd_max_request_bytes}")
    if args.leader_ttl < 2:
        raise ValueError(f"--leader-ttl must be >= 2 seconds (etcd's shortest lease), got {args.leader_ttl}")
