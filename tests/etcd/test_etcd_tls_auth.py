"""The etcd store over TLS with a client certificate and etcd's own authentication (a user with
read-write on the deployment's prefix only), against a real single-member etcd: what
`--etcd-cacert/--etcd-cert/--etcd-key/--etcd-user/--etcd-password(-file)` set up, in the store, the
election's calls and a real `rdzv-server` process."""
from __future__ import annotations

import dataclasses
import datetime as dt
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from rdzv_server.store.api import StoreError
from rdzv_server.store.etcd.client import EtcdClient, EtcdSettings, b64, created_at, prefix_end, put
from rdzv_server.store.etcd.store import EtcdStore
from rdzv_server.store.snapshots import snapshot
from tests.e2e.certs import make_ca, make_server_cert
from tests.e2e.harness import Proc, child_env, wait_until
from tests.etcd_cluster import ETCD, etcd_available
from tests.ports import free_port
from tests.unit.test_store import _builtins, every_state

PREFIX = "/secure/"


def make_client_cert(directory: str, ca, name: str, common_name: str | None) -> tuple[str, str]:
    """A client certificate signed by `ca`, with `common_name` as its CN or none at all (etcd's gateway
    refuses a certificate with a CN once auth is on); returns (cert PEM path, key PEM path)."""
    _, ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "rdzv tests")]
    if common_name:
        subject.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name(subject)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = os.path.join(directory, f"{name}.pem"), os.path.join(directory, f"{name}-key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


@dataclasses.dataclass
class SecureEtcd:
    settings: EtcdSettings          # user rdzv, a client certificate without a CN
    dir: str
    named_cert: tuple[str, str]     # a client certificate with a CN, from the same CA

    @property
    def root(self) -> EtcdSettings:
        return dataclasses.replace(self.settings, user="root", password="root-pw", prefix="/")


@pytest.fixture(scope="module")
def secure_etcd():
    """One etcd member serving https only to clients with a certificate of our CA; auth enabled with
    a root user and a user `rdzv` that may read and write PREFIX only."""
    assert etcd_available(), "etcd is not installed: run `make etcd` (Debian's etcd-server package)"
    tmp = tempfile.mkdtemp(prefix="etcd-tls-")
    proc = None
    try:
        ca = make_ca(tmp)
        server_cert, server_key = make_server_cert(tmp, ca)
        cert, key = make_client_cert(tmp, ca, "client", None)
        named = make_client_cert(tmp, ca, "named-client", "rdzv")
        client_port, peer_port = free_port(), free_port()
        url = f"https://127.0.0.1:{client_port}"
        log = open(os.path.join(tmp, "etcd.log"), "ab")
        proc = subprocess.Popen([ETCD, "--name", "s", "--data-dir", os.path.join(tmp, "data"),
                                 "--listen-client-urls", url, "--advertise-client-urls", url,
                                 "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
                                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
                                 "--initial-cluster", f"s=http://127.0.0.1:{peer_port}",
                                 "--cert-file", server_cert, "--key-file", server_key, "--trusted-ca-file", ca[0],
                                 "--client-cert-auth", "--logger", "zap", "--log-level", "error"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        admin = EtcdSettings((url,), PREFIX, cacert=ca[0], cert=cert, key=key, timeout_s=2.0)
        client = EtcdClient(admin)
        deadline = time.monotonic() + 30
        while True:                       # until it answers (it has just started): no event to wait on
            try:
                client.range("/probe")
                break
            except Exception:
                assert proc.poll() is None, f"etcd exited: {open(os.path.join(tmp, 'etcd.log')).read()[-2000:]}"
                assert time.monotonic() < deadline, "the TLS etcd did not come up"
                time.sleep(0.1)
        for route, body in (
                ("/v3/auth/user/add", {"name": "root", "password": "root-pw"}),
                ("/v3/auth/role/add", {"name": "root"}),
                ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                ("/v3/auth/user/add", {"name": "rdzv", "password": "rdzv-pw"}),
                ("/v3/auth/role/add", {"name": "rdzv-rw"}),
                ("/v3/auth/role/grant", {"name": "rdzv-rw", "perm": {"permType": "READWRITE", "key": b64(PREFIX),
                                                                       "range_end": b64(prefix_end(PREFIX))}}),
                ("/v3/auth/user/grant", {"user": "rdzv", "role": "rdzv-rw"}),
                ("/v3/auth/enable", {})):
            client.call(route, body)
        client.close()
        yield SecureEtcd(dataclasses.replace(admin, user="rdzv", password="rdzv-pw"), tmp, named)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def secure(secure_etcd):
    """The settings, with the deployment's keys cleared (as root) after each test."""
    yield secure_etcd.settings
    root = EtcdClient(secure_etcd.root)
    root.call("/v3/kv/deleterange", {"key": b64(PREFIX), "range_end": b64(prefix_end(PREFIX))})
    root.close()


def test_the_store_works_over_tls_as_an_etcd_user(secure):
    store = EtcdStore(secure)
    client = EtcdClient(secure)
    ok, reply = client.txn([created_at(store.leader_key, 0)], [put(store.leader_key, b"https://me:1")])
    assert ok
    store.fence = int(reply["header"]["revision"])
    rz = every_state()
    store.write([snapshot(job, job.nodes, job.events, reset=True) for job in rz.jobs.values()], 10.0)
    store.close(11.0)
    loaded = EtcdStore(secure).load()
    assert _builtins(loaded.jobs) == _builtins(rz.jobs) and loaded.clean_shutdown
    lease, _ = client.grant(5)                   # the election's calls: leases too
    assert client.keep_alive(lease) > 0
    client.revoke(lease)
    assert client.keep_alive(lease) == 0
    client.close()


def test_a_wrong_password_or_a_key_outside_the_prefix_is_refused_by_name(secure):
    with pytest.raises(StoreError, match="refused the user 'rdzv'.*authentication failed"):
        EtcdStore(dataclasses.replace(secure, password="wrong")).load()
    with pytest.raises(StoreError, match="permission denied"):
        EtcdStore(dataclasses.replace(secure, prefix="/elsewhere/")).load()


def test_without_a_client_certificate_etcd_refuses_the_connection(secure):
    with pytest.raises(StoreError, match="no etcd member answered.*no client certificate was offered"):
        EtcdStore(dataclasses.replace(secure, cert=None, key=None)).load()


def test_a_client_certificate_with_a_common_name_is_refused_with_what_to_do(secure_etcd, secure):
    cert, key = secure_etcd.named_cert
    with pytest.raises(StoreError) as refused:
        EtcdStore(dataclasses.replace(secure, cert=cert, key=key)).load()
    message = str(refused.value)
    assert "CommonName" in message and "without a CN" in message and "no etcd member answered" not in message


def readyz(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_rdzv_server_leads_with_the_etcd_flags_and_hands_back_on_sigterm(secure_etcd, secure):
    password_file = os.path.join(secure_etcd.dir, "rdzv.password")
    with open(password_file, "w") as f:
        f.write("rdzv-pw\n")
    argv = [sys.executable, "-m", "rdzv_server.cli", "--host", "127.0.0.1", "--port", "0", "--log-level", "info",
            "--store", secure.endpoints[0].replace("https://", "etcd://"), "--etcd-prefix", PREFIX.rstrip("/"),
            "--etcd-cacert", secure.cacert, "--etcd-cert", secure.cert, "--etcd-key", secure.key,
            "--etcd-user", "rdzv", "--etcd-password-file", password_file]
    server = Proc(argv, child_env(), "replica")
    try:
        port = int(server.wait_for_line(r"listening on http://[^:]+:(\d+)", 30).group(1))
        server.wait_for_line(r"elected leader", 30)
        assert wait_until(lambda: readyz(port) == 200, 10, "the leader to be ready")
        client = EtcdClient(secure)                       # the election key is under the prefix, naming it
        (leader,), _ = client.range(PREFIX + "leader")
        assert leader.value.decode() == f"http://127.0.0.1:{port}" and leader.lease
        os.kill(server.pid, signal.SIGTERM)
        assert server.wait(30) == 0
        assert client.range(PREFIX + "leader")[0] == []  # resigned: the lease revoked, its key gone
        client.close()
    finally:
        server.kill_all()


def test_rdzv_server_with_a_wrong_etcd_password_says_so_and_is_not_ready(secure_etcd, secure):
    argv = [sys.executable, "-m", "rdzv_server.cli", "--host", "127.0.0.1", "--port", "0", "--log-level", "info",
            "--store", secure.endpoints[0].replace("https://", "etcd://"), "--etcd-prefix", PREFIX,
            "--etcd-cacert", secure.cacert, "--etcd-cert", secure.cert, "--etcd-key", secure.key,
            "--etcd-user", "rdzv"]
    server = Proc(argv, child_env(RDZV_ETCD_PASSWORD="not-it"), "replica")
    try:
        port = int(server.wait_for_line(r"listening on http://[^:]+:(\d+)", 30).group(1))
        server.wait_for_line(r"election on etcd: .*refused the user 'rdzv'.*authentication failed", 30)
        assert readyz(port) == 503
        assert "Traceback" not in server.output
    finally:
        server.kill_all()
