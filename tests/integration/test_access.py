"""Who may use which route: tokens for agents, views and admin; browser safety; security headers."""
from __future__ import annotations

import base64

import msgpack
import pytest

from rdzv_server.web.access import Access, TokenError, read_token
from rdzv_server.web.app import COORDINATOR, create_app
from tests.integration.support import start_app, url

AGENT = b"agent-token-0123456789abcdef"
ADMIN = b"admin-token-0123456789abcdef"
MSGPACK = {"Content-Type": "application/msgpack"}


def bearer(token: bytes) -> dict[str, str]:
    return {"Authorization": f"Bearer {token.decode()}"}


def join_body(node: str) -> bytes:
    return msgpack.packb({"v": 1, "node_id": node, "addr": "10.0.0.1", "local_world_size": 1, "master_port": 1,
                          "config": {"min_nodes": 2, "max_nodes": 2}})


@pytest.fixture
async def tokened():
    srv = await start_app(create_app(access=Access(agent_token=AGENT, admin_token=ADMIN)))
    try:
        yield srv
    finally:
        await srv.close()


async def test_agent_routes_need_the_agent_token_and_a_refusal_changes_nothing(tokened, http):
    for headers in ({}, bearer(b"wrong-token-0123456789"), bearer(ADMIN)):
        async with http.post(url(tokened, "/v1/jobs/j/join"), data=join_body("a"),
                             headers={**MSGPACK, **headers}) as resp:
            reply = msgpack.unpackb(await resp.read())
            assert resp.status == 401 and reply["code"] == "unauthorized" and "--token-file" in reply["message"]
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert "j" not in tokened.app[COORDINATOR].core.jobs
    async with http.post(url(tokened, "/v1/jobs/j/join"), data=join_body("a"),
                         headers={**MSGPACK, **bearer(AGENT)}) as resp:
        assert resp.status == 200 and msgpack.unpackb(await resp.read())["node_state"] == "waiting"


async def test_views_need_a_token_bearer_or_basic_health_never(tokened, http):
    for path in ("/v1/status", "/", "/metrics", "/v1/jobs/x/events"):
        async with http.get(url(tokened, path)) as resp:
            assert resp.status == 401, path
            assert resp.headers["WWW-Authenticate"].startswith("Basic")   # a browser asks for it
    async with http.get(url(tokened, "/healthz")) as resp:
        assert resp.status == 200
    basic = base64.b64encode(b"anyone:" + AGENT).decode()
    for headers in (bearer(AGENT), bearer(ADMIN), {"Authorization": f"Basic {basic}"}):
        async with http.get(url(tokened, "/v1/status"), headers=headers) as resp:
            assert resp.status == 200
            assert AGENT.decode() not in await resp.text()


async def test_public_status_opens_views_but_not_agent_or_admin_routes(http):
    srv = await start_app(create_app(access=Access(agent_token=AGENT, admin_token=ADMIN, public_status=True)))
    try:
        async with http.get(url(srv, "/v1/status")) as resp:
            assert resp.status == 200
        async with http.post(url(srv, "/v1/jobs/j/join"), data=join_body("a"), headers=MSGPACK) as resp:
            assert resp.status == 401
        async with http.post(url(srv, "/v1/admin/jobs/j/close"), data=b"{}",
                             headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 401
    finally:
        await srv.close()


async def test_admin_token_is_needed_even_from_loopback_and_the_agent_token_is_not_enough(tokened, http):
    async with http.post(url(tokened, "/v1/jobs/j/join"), data=join_body("a"),
                         headers={**MSGPACK, **bearer(AGENT)}) as resp:
        assert resp.status == 200
    json_type = {"Content-Type": "application/json"}
    for headers in ({}, bearer(AGENT)):
        async with http.post(url(tokened, "/v1/admin/jobs/j/close"), data=b"{}",
                             headers={**json_type, **headers}) as resp:
            assert resp.status == 401 and (await resp.json())["code"] == "unauthorized"
    assert tokened.app[COORDINATOR].core.jobs["j"].state.value == "waiting"
    async with http.post(url(tokened, "/v1/admin/jobs/j/close"), data=b'{"reason": "ok"}',
                         headers={**json_type, **bearer(ADMIN)}) as resp:
        assert resp.status == 200 and (await resp.json())["state"] == "closed"


async def test_a_cross_site_page_cannot_act_even_with_a_json_body(http):
    srv = await start_app(create_app())
    try:
        async with http.post(url(srv, "/v1/jobs/j/join"), data=join_body("a"), headers=MSGPACK) as resp:
            assert resp.status == 200
        async with http.post(url(srv, "/v1/admin/jobs/j/close"), data=b"{}",
                             headers={"Content-Type": "application/json",
                                      "Origin": "http://evil.example"}) as resp:
            assert resp.status == 403 and "origin" in (await resp.json())["message"]
        async with http.post(url(srv, "/v1/admin/jobs/j/close"), data=b"{}",
                             headers={"Content-Type": "text/plain"}) as resp:
            assert resp.status == 415
        assert srv.app[COORDINATOR].core.jobs["j"].state.value == "waiting"
        own = f"http://127.0.0.1:{srv.port}"       # the page itself (same origin) may
        async with http.post(url(srv, "/v1/admin/jobs/j/close"), data=b"{}",
                             headers={"Content-Type": "application/json", "Origin": own}) as resp:
            assert resp.status == 200
    finally:
        await srv.close()


async def test_views_without_a_token_answer_only_their_own_host_names(http):
    srv = await start_app(create_app(access=Access(allowed_hosts=frozenset({"rdzv.example"}))))
    try:
        for host, status in (("evil.example", 403), ("evil.example:29400", 403), ("localhost:1", 200),
                             ("rdzv.example", 200), ("10.0.0.9:29400", 200), ("[::1]:29400", 200)):
            async with http.get(url(srv, "/v1/status"), headers={"Host": host}) as resp:
                assert resp.status == status, host
                if status == 403:
                    assert "--allowed-host" in (await resp.json())["message"]
    finally:
        await srv.close()


async def test_a_page_rebound_to_loopback_cannot_close_a_job_or_join_one(http):
    """DNS rebinding: a page at evil.example whose name now resolves to 127.0.0.1 sends requests from
    loopback, and its Origin matches the Host it sends. Without tokens neither may act."""
    srv = await start_app(create_app())
    try:
        async with http.post(url(srv, "/v1/jobs/j/join"), data=join_body("a"), headers=MSGPACK) as resp:
            assert resp.status == 200
        evil = f"evil.example:{srv.port}"
        page = {"Host": evil, "Origin": f"http://{evil}"}
        async with http.post(url(srv, "/v1/admin/jobs/j/close"), data=b"{}",
                             headers={"Content-Type": "application/json", **page}) as resp:
            assert resp.status == 403
            assert "--allowed-host 'evil.example'" in (await resp.json())["message"]
        async with http.post(url(srv, "/v1/admin/jobs/j/close"), data=b"{}",      # no Origin at all
                             headers={"Content-Type": "application/json", "Host": evil}) as resp:
            assert resp.status == 403
        for headers in (page, {"Host": f"127.0.0.1:{srv.port}", "Origin": "http://evil.example"},
                        {"Host": evil, "Origin": "null"}):
            async with http.post(url(srv, "/v1/jobs/k/join"), data=join_body("b"),
                                 headers={**MSGPACK, **headers}) as resp:
                assert resp.status == 403, headers
                assert "web page" in msgpack.unpackb(await resp.read())["message"]
        assert srv.app[COORDINATOR].core.jobs["j"].state.value == "waiting"
        assert "k" not in srv.app[COORDINATOR].core.jobs
        for host in ("localhost", f"127.0.0.1:{srv.port}"):                         # rdzv-ctl on the host
            async with http.post(url(srv, "/v1/admin/jobs/j/resize"), data=b'{"max_nodes": 3}',
                                 headers={"Content-Type": "application/json", "Host": host}) as resp:
                assert resp.status == 200, host
    finally:
        await srv.close()


async def test_agents_and_token_holders_may_name_the_server_by_any_dns_name(tokened, http):
    """Agents behind a Kubernetes Service or a DNS alias send that name as Host, and no Origin."""
    service = {"Host": "rdzv-server.ns.svc:29400"}
    open_srv = await start_app(create_app())
    try:
        async with http.post(url(open_srv, "/v1/jobs/j/join"), data=join_body("a"),
                             headers={**MSGPACK, **service}) as resp:
            assert resp.status == 200                                  # no token on this server
    finally:
        await open_srv.close()
    async with http.post(url(tokened, "/v1/jobs/j/join"), data=join_body("a"),
                         headers={**MSGPACK, **service, **bearer(AGENT)}) as resp:
        assert resp.status == 200
    async with http.post(url(tokened, "/v1/admin/jobs/j/close"), data=b"{}",
                         headers={"Content-Type": "application/json", **service, **bearer(ADMIN)}) as resp:
        assert resp.status == 200 and (await resp.json())["state"] == "closed"


async def test_allowed_host_names_admit_admin_actions_without_a_token(http):
    srv = await start_app(create_app(access=Access(allowed_hosts=frozenset({"rdzv.example"}))))
    try:
        async with http.post(url(srv, "/v1/jobs/j/join"), data=join_body("a"), headers=MSGPACK) as resp:
            assert resp.status == 200
        async with http.post(url(srv, "/v1/admin/jobs/j/close"), data=b"{}",
                             headers={"Content-Type": "application/json", "Host": "rdzv.example:29400"}) as resp:
            assert resp.status == 200
    finally:
        await srv.close()


async def test_html_has_security_headers_and_compressed_bodies_are_refused(http):
    srv = await start_app(create_app())
    try:
        async with http.get(url(srv, "/")) as resp:
            assert resp.status == 200
            assert resp.headers["X-Content-Type-Options"] == "nosniff"
            assert "default-src 'none'" in resp.headers["Content-Security-Policy"]
        async with http.post(url(srv, "/v1/jobs/j/join"), data=b"\x1f\x8b\x08garbage",
                             headers={**MSGPACK, "Content-Encoding": "gzip"}) as resp:
            assert resp.status == 415
            assert "Content-Encoding" in msgpack.unpackb(await resp.read())["message"]
        assert "j" not in srv.app[COORDINATOR].core.jobs
    finally:
        await srv.close()


def test_token_files_are_checked_with_one_clear_line(tmp_path):
    good = tmp_path / "token"
    good.write_text("  " + AGENT.decode() + "\n")
    assert read_token(str(good), "--token-file") == AGENT
    for content, needle in (("short", "at least 16"), ("has a space in the middle!!", "printable"),
                            ("x" * 5000, "longer than")):
        bad = tmp_path / "bad"
        bad.write_text(content)
        with pytest.raises(TokenError, match=needle):
            read_token(str(bad), "--token-file")
    with pytest.raises(TokenError, match="--admin-token-file .*missing"):
        read_token(str(tmp_path / "missing"), "--admin-token-file")



async def test_readiness_is_open_and_says_ready_once_the_state_is_loaded(tokened, http):
    async with http.get(url(tokened, "/readyz")) as resp:
        assert resp.status == 200 and (await resp.json()) == {"ready": True}
    tokened.app[COORDINATOR].release_polls()          # stopping: a load balancer should look elsewhere
    async with http.get(url(tokened, "/readyz")) as resp:
        assert resp.status == 503
