"""Active/standby replicas: which one serves, decided by an election on etcd.

The election key (`P leader`: the leader's URL, on its etcd lease) is won by a transaction creating it only if it
is absent; its create revision is the leader's fence, compared by every commit (store.py), so a leader that missed
losing the key commits nothing.
- The leader renews every TTL/4 and steps down (refusing requests at once) when the lease may have lapsed (last
  renewal's send time + the TTL granted - a margin): a leader frozen, cut off or without etcd stops by itself.
- A standby reads the key every POLL_S and campaigns when it is gone. If the named leader's port refuses
  connections (process gone, host up) it revokes that lease at once; a stopped or cut-off leader refuses nothing,
  so its TTL ends it, and one wrongly thought gone loses its lease, never its fence.
- A replica revokes a key naming its own URL (its previous process died); a clean stop revokes the lease after
  the last commit, so a standby takes over within POLL_S.
Calls run on the election's own thread, timed out within the lease (`request_timeout_s`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from rdzv_server.store.api import StoreError
from rdzv_server.store.etcd.client import (
    EtcdClient,
    EtcdRefused,
    EtcdSettings,
    EtcdUnavailable,
    created_at,
    put,
    request_timeout_s,
)
from rdzv_server.store.etcd.store import EtcdStore

log = logging.getLogger("rdzv_server")

POLL_S = 0.2                # a standby reads the election key this often
CONNECT_TIMEOUT_S = 0.5       # connecting to the leader's port: no answer in this long proves nothing
DEFAULT_TTL_S = 5           # the leader's etcd lease (etcd's own minimum is about 2 s)

T = TypeVar("T")


class Leadership:
    def __init__(self, settings: EtcdSettings, store: EtcdStore, advertise_url: str, ttl_s: int = DEFAULT_TTL_S, *,
                 on_elected: Callable[[], Awaitable[None]], on_deposed: Callable[[], Awaitable[None]]) -> None:
        self.ttl_s = ttl_s
        self.margin_s = min(1.0, ttl_s / 4)
        self._client = EtcdClient(dataclasses.replace(settings, timeout_s=request_timeout_s(ttl_s)))
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rdzv-election")
        self.store = store
        self.key = store.leader_key
        self.advertise_url = advertise_url
        self.on_elected = on_elected
        self.on_deposed = on_deposed
        self.leading = False
        self._leader_url: str | None = None
        self.on_news: Callable[[], None] = lambda: None     # the leader became known, or unknown
        self._lease = 0
        self._sure_until = 0.0                    # monotonic: our lease surely lives until then
        self._store_refused = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()
        # called from the store's thread: a commit was refused, so another replica leads
        store.on_deposed = lambda: self._loop.call_soon_threadsafe(self._store_refused.set)

    @property
    def leader_url(self) -> str | None:
        """Where the leader is, as far as this replica knows (its own URL while it leads)."""
        return self._leader_url

    @leader_url.setter
    def leader_url(self, url: str | None) -> None:
        if url != self._leader_url:
            self._leader_url = url
            self.on_news()

    def sure(self) -> bool:
        """Whether this replica leads and its lease surely still lives (checked on every request)."""
        return self.leading and time.monotonic() < self._sure_until

    def electing(self) -> bool:
        """No replica serves that this one knows of (no key, or its leader found gone), or this one won and loads
        the state."""
        return not self._stopping and (self.leader_url is None or (self.leading and self.sure()))

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="rdzv-election")

    def stop_campaigning(self) -> None:
        """A clean stop begins: a standby stops here; a leader keeps its lease (and fence) for its last commits,
        then `resign` gives it back."""
        self._stopping = True
        if not self.leading and self._task is not None:
            self._task.cancel()

    async def run(self) -> None:
        """Stand by, lead when elected, step down when the lease is lost; until cancelled."""
        failing = ""
        while True:
            try:
                await self._stand_by()
                failing = ""
                await self._lead()
            except (EtcdUnavailable, EtcdRefused, StoreError) as exc:
                if str(exc) != failing:
                    log.warning("election on etcd: %s; retrying", exc)
                    failing = str(exc)
                await asyncio.sleep(POLL_S)     # a retry pause, not a synchronisation wait

    async def resign(self) -> None:
        """A clean stop: give the lease back so a standby takes over at once."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._lease:
            lease, self._lease = self._lease, 0
            self.leading = False
            try:
                await self._call(self._client.revoke, lease)
            except (EtcdUnavailable, EtcdRefused) as exc:
                log.warning("could not hand leadership back (%s): a standby takes over when the lease expires", exc)
        await self._loop.run_in_executor(self._executor, self._client.close)
        self._executor.shutdown(wait=False)

    # ---- standing by ----

    async def _stand_by(self) -> None:
        """Return once this replica has won the election."""
        announced = None
        while True:
            kvs, _ = await self._call(self._client.range, self.key)
            if not kvs:
                self.leader_url = announced = None
                if await self._campaign():
                    return
                continue
            url, lease = kvs[0].value.decode(errors="replace"), kvs[0].lease
            if url == self.advertise_url:
                log.warning("the election key names this replica's URL from an earlier run: releasing it")
                await self._call(self._client.revoke, lease)
                continue
            self.leader_url = url
            if url != announced:
                log.info("standing by: the leader is %s", url, extra={"event": "standby"})
                announced = url
            if lease and not await _listening(url):
                log.warning("the leader at %s refuses connections (its process is gone): revoking its lease", url)
                self.leader_url = announced = None      # agents are not sent to it any more
                await self._call(self._client.revoke, lease)
                continue
            await asyncio.sleep(POLL_S)         # polling the key; a watch would save little for two replicas

    async def _campaign(self) -> bool:
        sent = time.monotonic()
        lease, ttl = await self._call(self._client.grant, self.ttl_s)
        ok, reply = await self._call(self._client.txn, [created_at(self.key, 0)],
                                     [put(self.key, self.advertise_url.encode(), lease)])
        if not ok:
            await self._call(self._client.revoke, lease)
            return False
        self._lease, self._sure_until = lease, sent + ttl - self.margin_s
        self.store.fence = int(reply["header"]["revision"])
        self.leading, self.leader_url = True, self.advertise_url
        log.info("elected leader (fence revision %d, lease TTL %d s)", self.store.fence, ttl,
                 extra={"event": "elected"})
        return True

    # ---- leading ----

    async def _lead(self) -> None:
        """Serve until the lease is lost, cannot be renewed, or the store is refused; then step down."""
        self._store_refused.clear()
        keeper = asyncio.create_task(self._keep_alive(), name="rdzv-lease")
        refused = asyncio.create_task(self._store_refused.wait())
        try:
            await self.on_elected()
            await asyncio.wait({keeper, refused}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.leading, self.leader_url = False, None
            self.store.fence = None
            keeper.cancel()
            refused.cancel()
            await asyncio.gather(keeper, refused, return_exceptions=True)
            if not self._stopping:
                log.warning("stepping down: no longer the leader", extra={"event": "stepped_down"})
                await self.on_deposed()
        lease, self._lease = self._lease, 0
        with contextlib.suppress(EtcdUnavailable, EtcdRefused):
            await self._call(self._client.revoke, lease)     # if it still lives, let another replica win now

    async def _keep_alive(self) -> None:
        """Renew the lease; return when it is gone or can no longer be known to live."""
        while True:
            pause = self.ttl_s / 4 if time.monotonic() + self.ttl_s / 4 < self._sure_until else POLL_S
            await asyncio.sleep(pause)          # periodic renewal, not synchronisation
            if time.monotonic() >= self._sure_until:
                log.error("leadership lease not renewed for %d s: stepping down", self.ttl_s)
                return
            sent = time.monotonic()
            try:
                ttl = await self._call(self._client.keep_alive, self._lease)
            except (EtcdUnavailable, EtcdRefused) as exc:
                log.warning("cannot renew the leadership lease: %s", exc)
                continue
            if ttl <= 0:
                log.error("the leadership lease has expired in etcd: another replica may lead")
                return
            self._sure_until = sent + ttl - self.margin_s

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._loop.run_in_executor(self._executor, fn, *args)


async def _listening(url: str) -> bool:
    """False only when the host of `url` refuses a connection to its port (nothing listens there)."""
    parsed = urllib.parse.urlsplit(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parsed.hostname, port), CONNECT_TIMEOUT_S)
    except ConnectionRefusedError:
        return False
    except (OSError, asyncio.TimeoutError):
        return True
    writer.close()
    return True
