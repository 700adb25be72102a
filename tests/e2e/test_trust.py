"""Trust end to end: real agents with a token over TLS; forgeries by a client that holds the job's
token but not the node's credential are refused and the job trains on untouched."""
from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request

import msgpack
import pytest

from tests.e2e.certs import make_ca, make_server_cert
from tests.e2e.harness import SCRIPTS, job_view, read_jsonl, read_records, wait_until

pytestmark = pytest.mark.e2e
TOKEN = "e2e-token-0123456789abcdef0123456789"
LOOP = os.path.join(SCRIPTS, "elastic_loop.py")
ALLREDUCE = os.path.join(SCRIPTS, "allreduce.py")
LIMIT = 90.0


def token_file(tmp_path) -> str:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


def test_a_job_runs_over_tls_with_a_token_and_a_missing_token_or_wrong_ca_is_one_line(cluster, tmp_path):
    ca = make_ca(str(tmp_path))
    cert, key = make_server_cert(str(tmp_path), ca)
    other_ca, _, _ = make_ca(str(tmp_path), "other-ca")
    tokens = token_file(tmp_path)
    cluster.start_server("--token-file", tokens, "--tls-cert", cert, "--tls-key", key, "--state-dir", "none")
    cluster.token, cluster.ca = TOKEN, ca[0]
    endpoint = f"https://{cluster.endpoint()}"
    base = ("--nnodes", "2", "--nproc", "1", "--job-id", "tls-job", "--lease-timeout", "3")

    no_token = cluster.agent("--endpoint", endpoint, "--tls-ca", ca[0], "--node-id", "x", *base, ALLREDUCE,
                             name="no-token", env={"OUT_DIR": str(tmp_path)})
    assert no_token.wait(60) == 1
    assert "refused this agent" in no_token.output and "token" in no_token.output
    assert "Traceback" not in no_token.output
    wrong_ca = cluster.agent("--endpoint", endpoint, "--tls-ca", other_ca, "--token-file", tokens, "--node-id", "y",
                             *base, ALLREDUCE, name="wrong-ca", env={"OUT_DIR": str(tmp_path)})
    assert wrong_ca.wait(60) == 1
    assert "TLS" in wrong_ca.output and "--tls-ca" in wrong_ca.output and "Traceback" not in wrong_ca.output

    out = tmp_path / "out"
    out.mkdir()
    agents = [cluster.agent("--endpoint", endpoint, "--tls-ca", ca[0], "--node-id", node, *base, ALLREDUCE,
                            name=node, env={"OUT_DIR": str(out), **given})
              for node, given in (("a", {"RDZV_TOKEN_FILE": tokens}), ("b", {"RDZV_TOKEN": TOKEN}))]
    assert [a.wait(LIMIT) for a in agents] == [0, 0], "\n".join(a.output for a in agents)
    records = read_records(out)
    assert sorted(r["env"]["RANK"] for r in records) == ["0", "1"] and {r["sum"] for r in records} == {3.0}
    for r in records:          # the token stays with the agent: no worker sees it, nor where its file is
        assert r["env"]["RDZV_TOKEN"] is None and r["env"]["RDZV_TOKEN_FILE"] is None, r["env"]
    assert job_view(cluster, "tls-job")["state"] == "succeeded"


def forge(port: int, action: str, body: dict, *, credential: str | None) -> tuple[int, dict]:
    """One agent request in a member's name, with the job's token but not the node's credential."""
    if credential is not None:
        body = {**body, "credential": credential}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/jobs/forged/{action}",
                                     data=msgpack.packb({"v": 1, "node_id": "node-a", **body}), method="POST",
                                     headers={"Content-Type": "application/msgpack",
                                              "Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, msgpack.unpackb(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, msgpack.unpackb(exc.read())


def poll_and_drop(port: int, credential: str | None) -> bytes:
    """A long-poll in the member's name whose connection is then dropped (as a dying agent's would)."""
    body = {"v": 1, "node_id": "node-a", "known_round": 1, "wait_s": 30.0}
    if credential is not None:
        body["credential"] = credential
    payload = msgpack.packb(body)
    head = (f"POST /v1/jobs/forged/poll HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/msgpack\r\n"
            f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + payload)
        return sock.recv(200)          # a refusal answers at once; a held poll would time out here


def test_forged_requests_for_a_member_are_refused_and_the_job_trains_on(cluster, tmp_path):
    cluster.start_server("--token-file", token_file(tmp_path), "--state-dir", "none")
    cluster.token = TOKEN
    out = tmp_path / "out"
    out.mkdir()
    agents = [cluster.agent("--endpoint", cluster.endpoint(), "--token-file", token_file(tmp_path), "--nnodes", "2",
                            "--nproc", "1", "--job-id", "forged", "--node-id", f"node-{n}", "--lease-timeout", "3",
                            LOOP, name=n, env={"OUT_DIR": str(out), "NODE": n, "STEP_SLEEP": "0.1"}) for n in "ab"]

    def steps() -> list[dict]:
        return [r for r in read_jsonl(out, "steps-") if r["kind"] == "step"]

    wait_until(lambda: {r["rank"] for r in steps()} == {0, 1}, LIMIT, "both ranks training")
    before = job_view(cluster, "forged")
    pids = {r["pid"] for r in read_jsonl(out, "steps-")}
    round_id = before["round_id"]
    failure = [{"local_rank": 0, "rank": 0, "exitcode": 1}]
    for credential, code in ((None, 401), ("stolen-guess", 403)):
        for action, body in (("success", {"round_id": round_id}),
                             ("failure", {"round_id": round_id, "failures": failure}),
                             ("leave", {"reason": "forged"}), ("poll", {"known_round": round_id, "wait_s": 0})):
            status, reply = forge(cluster.port, action, body, credential=credential)
            assert status == code, (action, reply)
        answer = poll_and_drop(cluster.port, credential)
        assert answer.startswith(f"HTTP/1.1 {code}".encode()), answer
        status, reply = forge(cluster.port, "join", {"addr": "6.6.6.6", "local_world_size": 1, "master_port": 1,
                                                     "config": {"min_nodes": 2, "max_nodes": 2, "lease_timeout_s": 3}},
                              credential=credential)
        assert status == 409 and reply["code"] == "node_conflict", reply

    seen = len(steps())
    wait_until(lambda: len(steps()) > seen + 20, LIMIT, "training going on after the forgeries")
    after = job_view(cluster, "forged")
    assert after["state"] == "running" and after["round_id"] == round_id and after["restart_count"] == 0
    assert {n["node_id"]: n["addr"] for n in after["nodes"]} == {n["node_id"]: n["addr"] for n in before["nodes"]}
    assert all(r["master_addr"] == "127.0.0.1" for r in read_jsonl(out, "steps-"))
    assert {r["pid"] for r in read_jsonl(out, "steps-")} == pids     # no worker was restarted
    (out / "stop").write_text("")
    assert [a.wait(LIMIT) for a in agents] == [0, 0]
    assert job_view(cluster, "forged")["state"] == "succeeded"
    assert not any(e["kind"] in ("node_lost", "node_left", "worker_failed")
                   for e in cluster.get("/v1/jobs/forged/events")["events"]), json.dumps(after)
