"""The human status page in a real browser: headless Chromium renders `GET /` and `GET /jobs/{id}` of
a live server whose job just had a worker fail and runs again, with the picture of its history.

Chromium comes from Debian's `chromium` package (`make chromium`); without it this test fails, it is
never skipped. Waits poll the server's JSON API; the page is then checked against that same JSON.
A screenshot of the overview is kept at test-artifacts/status-page.png (and the job page beside it,
test-artifacts/status-page-job.png: its picture shows the failed round and the restart). The picture's
rendered size is measured in a copy of the page with a script added (the page itself has none).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from html.parser import HTMLParser

import pytest

from tests.e2e.harness import ROOT, SCRIPTS, job_events, job_view, wait_until

pytestmark = pytest.mark.e2e
CHAOS = os.path.join(SCRIPTS, "chaos_worker.py")      # plain python: records its round, idles
JOB = "status-page-e2e"
NODES = ("node-alpha-7", "node-bravo-3")
FAST = ("--lease-timeout", "3", "--last-call", "1", "--stop-timeout", "2")
LIMIT = 90.0
BROWSER_LIMIT = 60.0
ARTIFACTS = os.path.join(ROOT, "test-artifacts")


# ---------------------------------------------------------------------------------------- the browser


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not installed: run `make chromium` (installs Debian's chromium package); "
                    "the status page test needs a real browser", pytrace=False)
    return path


def _kill_group(proc: subprocess.Popen) -> None:
    """Chromium forks a zygote, renderers and a crash handler: all share the session we gave it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_chromium(tmp_path, *args: str) -> str:
    """Run headless Chromium once (own profile, own session); return its stdout. Killed on timeout."""
    argv = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-extensions", f"--user-data-dir={tmp_path / 'chromium-profile'}", *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=BROWSER_LIMIT)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        pytest.fail(f"chromium did not finish within {BROWSER_LIMIT:g}s: {argv}", pytrace=False)
    finally:
        _kill_group(proc)      # whatever it left behind, also after a clean exit
    assert proc.returncode == 0, f"chromium exited {proc.returncode}: {argv}\n{err[-4000:]}"
    return out


def dump_dom(tmp_path, url: str) -> Element:
    """The DOM Chromium built from `url`, parsed. (--dump-dom itself needs scripts enabled, so "renders
    without JavaScript" is checked as: the page has no script at all.)"""
    dom = parse(run_chromium(tmp_path, "--dump-dom", url))
    assert dom.find_all(lambda e: e.tag == "html"), f"chromium returned no document for {url}"
    assert not dom.find_all(lambda e: e.tag == "script"), f"{url} has a script: the page must not need one"
    return dom


# Added to a copy of the job page (the page itself has no script): the rendered boxes of its picture.
MEASURE = """<script>
const svg = document.querySelector("svg.history"), box = e => e.getBoundingClientRect();
const marks = sel => [...svg.querySelectorAll(sel)].map(
    e => [e.getAttribute("data-round") || e.getAttribute("data-rounds") || e.getAttribute("data-kind"),
          box(e).width, box(e).height]);
const out = {svg: [box(svg).width, box(svg).height], rounds: marks("[data-round], [data-rounds]"),
             failures: marks('[data-kind="worker_failed"]')};
document.body.insertAdjacentHTML("beforeend", "<pre id=measure></pre>");
document.getElementById("measure").textContent = JSON.stringify(out);
</script>"""


def rounds_drawn(labels: list[str]) -> list[int]:
    """The rounds a picture's bars stand for, from their labels: "7" one round, "3-5" a group of narrow
    ones (a round shorter than a few pixels, as a first round cut short by a crash is when the page is
    drawn long after, is drawn with its neighbours)."""
    out: list[int] = []
    for label in labels:
        first, _, last = label.partition("-")
        out += range(int(first), int(last or first) + 1)
    return sorted(out)


def bar_labels(picture) -> list[str]:
    return [e.attrs.get("data-round") or e.attrs["data-rounds"]
            for e in picture.find_all(lambda e: "data-round" in e.attrs or "data-rounds" in e.attrs)]


def measure_picture(tmp_path, html: str) -> dict:
    """The sizes Chromium lays out for the picture in `html` (a page as served), at the screenshot's size."""
    copy = tmp_path / "measure.html"
    copy.write_text(html.replace("</body>", MEASURE + "</body>"))
    dom = parse(run_chromium(tmp_path, "--window-size=1400,1000", "--dump-dom", copy.as_uri()))
    return json.loads(one(dom, lambda e: e.attrs.get("id") == "measure", "measurements").text)


def screenshot(tmp_path, url: str, name: str) -> str:
    """A 1400x1000 PNG of `url`, checked, then moved to test-artifacts/NAME (replacing an older one)."""
    shot = tmp_path / name
    run_chromium(tmp_path, f"--screenshot={shot}", "--window-size=1400,1000", "--hide-scrollbars", url)
    assert shot.exists(), f"chromium wrote no screenshot of {url}"
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{shot} is not a PNG ({len(data)} bytes)"
    width, height = struct.unpack(">II", data[16:24])          # the IHDR chunk comes first
    assert (width, height) == (1400, 1000) and len(data) > 10_000, (width, height, len(data))
    os.makedirs(ARTIFACTS, exist_ok=True)
    path = os.path.join(ARTIFACTS, name)
    shutil.copyfile(shot, path + ".tmp")
    os.replace(path + ".tmp", path)
    return path


# ---------------------------------------------------------------------------------------- the DOM


class Element:
    def __init__(self, tag: str, attrs: dict[str, str]) -> None:
        self.tag, self.attrs = tag, attrs
        self.children: list[Element | str] = []

    @property
    def text(self) -> str:
        """Text content, whitespace collapsed (as a reader sees it)."""
        parts: list[str] = []

        def walk(el: Element) -> None:
            for c in el.children:
                if isinstance(c, str):
                    parts.append(c)
                elif c.tag not in ("style", "script", "head"):
                    walk(c)
        walk(self)
        return " ".join(" ".join(parts).split())

    def find_all(self, match: Callable[[Element], bool]) -> list[Element]:
        found = []
        for c in self.children:
            if isinstance(c, Element):
                if match(c):
                    found.append(c)
                found.extend(c.find_all(match))
        return found

    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())


class _TreeBuilder(HTMLParser):
    VOID = {"meta", "br", "img", "input", "link", "hr", "col", "area", "base", "wbr", "source"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack = [Element("#document", {})]

    def handle_starttag(self, tag, attrs):
        el = Element(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(el)
        if tag not in self.VOID:
            self.stack.append(el)

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                break

    def handle_data(self, data):
        self.stack[-1].children.append(data)


def parse(markup: str) -> Element:
    builder = _TreeBuilder()
    builder.feed(markup)
    builder.close()
    return builder.stack[0]


def one(root: Element, match: Callable[[Element], bool], what: str) -> Element:
    found = root.find_all(match)
    assert len(found) == 1, f"expected one {what}, found {len(found)}; page text: {root.text[:3000]}"
    return found[0]


# ---------------------------------------------------------------------------------------- the job


def start_agent(cluster, out, node: str):
    return cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "2:2", "--nproc", "1", "--job-id", JOB,
                         "--max-restarts", "3", "--node-id", node, *FAST, CHAOS, name=node,
                         env={"OUT_DIR": str(out), "NODE": node})


def workers(out) -> list[dict]:
    return [json.loads(p.read_text()) for p in out.glob("chaos-*.json")]


def failed_then_running(cluster) -> tuple[dict, list[dict]] | None:
    """(job, events) once a worker_failed event is followed by a completed round that now runs."""
    job = job_view(cluster, JOB, missing_ok=True)
    if job is None or job["state"] != "running":
        return None
    events = job_events(cluster, JOB)
    failed = [e for e in events if e["kind"] == "worker_failed"]
    after = [e for e in events if failed and e["kind"] == "round_completed" and e["seq"] > failed[0]["seq"]]
    if not after or job["round_id"] != after[-1]["round_id"] or sorted(n["node_id"] for n in job["nodes"]) != \
            sorted(NODES):
        return None
    return job, events


def http_get(cluster, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.port}{path}", timeout=10) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()


def test_status_pages_render_a_failed_and_restarted_job_in_chromium(cluster, tmp_path):
    chromium()      # fail first, before starting anything, when the browser is missing
    out = tmp_path / "out"
    out.mkdir()
    cluster.start_server()
    agents = [start_agent(cluster, out, node) for node in NODES]

    def state(what: str) -> Callable[[], str]:
        def describe() -> str:
            tails = "\n".join(f"--- {a.name}:\n" + "\n".join(a.output.splitlines()[-15:]) for a in agents)
            return f"{what}; job: {job_view(cluster, JOB, missing_ok=True)}; workers: {workers(out)}\n{tails}"
        return describe

    first = wait_until(lambda: {w["node"]: w for w in workers(out) if w["restart"] == 0} if
                       len({w["node"] for w in workers(out)}) == 2 else None, LIMIT,
                       state("both workers of the first round"))
    victim = NODES[1]
    (out / f"crash-{first[victim]['pid']}").write_text("crash")       # chaos_worker exits 1 on seeing it
    job, events = wait_until(lambda: failed_then_running(cluster), LIMIT,
                             state("a worker_failed event, then a running round"))
    failure = next(e for e in events if e["kind"] == "worker_failed")
    assert failure["node_id"] == victim and failure["data"]["exitcode"] == 1, failure
    base = f"http://127.0.0.1:{cluster.port}"

    # ---- the overview
    dom = dump_dom(tmp_path, base + "/")
    text = dom.text
    assert JOB in text and failure["message"] in text, text
    assert "1 job" in one(dom, lambda e: e.attrs.get("id") == "job-count", "job count").text
    assert one(dom, lambda e: e.attrs.get("id") == "server-time", "server time").text.endswith("Z")
    card = one(dom, lambda e: e.tag == "section" and e.attrs.get("data-job") == JOB, "job section")
    assert card.attrs["data-health"] == "green", card.attrs     # running, full, 1 of 3 restarts used
    assert "running" in {b.text for b in card.find_all(lambda e: "badge" in e.classes())}
    card_text = card.text
    assert f"#{job['round_id']}" in card_text and "1 / 3" in card_text, card_text
    members = card.find_all(lambda e: e.tag == "tr" and "data-node" in e.attrs)
    assert sorted(m.attrs["data-node"] for m in members) == sorted(NODES), card_text
    for m in members:
        assert m.attrs["data-node"] in m.text
    fail_row = one(card, lambda e: e.tag == "tr" and e.attrs.get("data-kind") == "worker_failed", "failure row")
    assert "ev-bad" in fail_row.classes() and failure["message"] in fail_row.text, fail_row.attrs
    link = one(card, lambda e: e.tag == "a" and "id" in e.classes(), "job link")
    assert link.attrs["href"] == f"/jobs/{JOB}"
    # the card's small picture of the history: a bar per round, the failure marked
    small = one(card, lambda e: e.tag == "svg", "picture on the card")
    assert small.classes() == {"history", "compact"} and small.attrs["role"] == "img", small.attrs
    rounds = sorted(e["round_id"] for e in events if e["kind"] == "round_completed")
    assert rounds_drawn(bar_labels(small)) == rounds, bar_labels(small)

    shot = screenshot(tmp_path, base + "/", "status-page.png")
    with open(shot, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(shot) > 10_000, shot

    # ---- the job's own page: config, last failure, the whole history newest first
    dom = dump_dom(tmp_path, f"{base}/jobs/{JOB}")
    text = dom.text
    assert JOB in text and "max_restarts" in text and "lease_timeout_s" in text, text
    assert failure["message"] in text and "Last failure" in text, text
    rows = dom.find_all(lambda e: e.tag == "tr" and "data-seq" in e.attrs)
    seqs = [int(r.attrs["data-seq"]) for r in rows]
    assert seqs == sorted(seqs, reverse=True) and seqs[-1] == 1, seqs
    assert {e["seq"] for e in events} <= set(seqs), (seqs, events)
    kinds = {r.attrs["data-kind"] for r in rows}
    assert {"job_created", "node_joined", "round_completed", "worker_failed"} <= kinds, kinds
    assert sorted(r.attrs["data-node"] for r in dom.find_all(lambda e: "data-node" in e.attrs)) == sorted(NODES)
    # the picture of the history: one bar per round (the running one outlined), the failure, the restart
    picture = one(dom, lambda e: e.tag == "svg" and "history" in e.classes(), "picture of the history")
    assert rounds_drawn(bar_labels(picture)) == rounds, (rounds, bar_labels(picture))
    bars = picture.find_all(lambda e: "data-round" in e.attrs)       # each round drawn alone, with its cause
    causes = {rounds[0]: "start"} | {r: "failure" for r in rounds[1:]}
    assert [b.attrs["data-cause"] for b in bars] == [causes[int(b.attrs["data-round"])] for b in bars], \
        [b.attrs for b in bars]
    assert bars[-1].attrs.get("data-current") == "1" and int(bars[-1].attrs["data-round"]) == rounds[-1]
    assert {e.attrs["data-kind"] for e in picture.find_all(lambda e: "data-kind" in e.attrs)} >= {
        "worker_failed", "restart", "node_joined"}
    assert f"History of job {JOB}" == picture.attrs["aria-label"] and "restarts used 1 of 3" in picture.text
    # ... laid out by the browser at a readable size, every bar and the failure with a box of its own
    status, _, served = http_get(cluster, f"/jobs/{JOB}?refresh=0")
    assert status == 200
    sizes = measure_picture(tmp_path, served)
    width, height = sizes["svg"]
    assert width >= 1000 and 150 <= height <= 400, sizes
    assert rounds_drawn([r for r, _, _ in sizes["rounds"]]) == rounds, sizes
    assert all(w >= 1 and h >= 10 for _, w, h in sizes["rounds"]) and sizes["failures"], sizes
    assert all(w > 0 for _, w, _ in sizes["failures"]), sizes
    screenshot(tmp_path, f"{base}/jobs/{JOB}", "status-page-job.png")

    # ---- an unknown job: a 404 page that says so, in HTML, escaped
    dom = dump_dom(tmp_path, f"{base}/jobs/no-such-job")
    assert "No job no-such-job on this server" in dom.text, dom.text
    assert JOB in dom.text           # it lists the jobs the server does know
    status, ctype, body = http_get(cluster, "/jobs/no-such-job")
    assert status == 404 and ctype.startswith("text/html"), (status, ctype)
    status, ctype, body = http_get(cluster, "/jobs/%3Cimg%20src%3Dx%20onerror%3Dalert(1)%3E")
    assert status == 404 and ctype.startswith("text/html"), (status, ctype, body[:500])
    assert "&lt;img src=x onerror=alert(1)&gt;" in body and "<img" not in body, body

    # the JSON API is unchanged by all this
    assert job_view(cluster, JOB)["state"] == "running"
