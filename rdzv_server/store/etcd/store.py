"""The durable store on etcd v3: snapshots.py's rows as keys under the deployment's prefix P.

`P leader` (election.py), `P meta` (last alive, clean stop), `P jobs/ID/row`, `P jobs/ID/n/BB` (node records in
NODE_BUCKETS buckets by node-id hash: a commit rewrites only changed buckets, keeping its ops under etcd's default
--max-txn-ops of 128 at any job size), `P jobs/ID/e/SEQ` (one commit's events keyed by the first's zero-padded
number; packs older than the kept history go by a range delete). Every commit compares the election key's create
revision from when this replica won, so a deposed leader commits nothing (`Deposed`). A batch over etcd's limits
is split between jobs, never inside one; if a later part fails, earlier parts stay committed though their replies
are refused, and the persister reads every job back, so the server holds what etcd holds. A load reads all keys at
one revision (paged), so it sees whole commits. Committed buckets and pack starts are kept here, so a bucket is
rewritten without a read (the leader is the only writer; a read-back replaces them).
"""
from __future__ import annotations

import zlib
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import msgspec

from rdzv_server.core.records import MAX_EVENTS_PER_JOB, JobRecord
from rdzv_server.store.api import Loaded, StoreError
from rdzv_server.store.etcd.client import (
    EtcdClient,
    EtcdRefused,
    EtcdSettings,
    EtcdUnavailable,
    KeyValue,
    created_at,
    delete,
    prefix_end,
    put,
)
from rdzv_server.store.snapshots import JobSnapshot, assemble, event_decoder, job_decoder, node_decoder

NODE_BUCKETS = 64
REQUEST_MARGIN = 64 * 1024           # room under --max-request-bytes for keys and framing
MIN_TXN_OPS = NODE_BUCKETS + 8       # one job's commit at most: every bucket, its row, events, the mark

T = TypeVar("T")
Buckets = dict[int, dict[str, bytes]]       # bucket -> node id -> encoded record

_encoder = msgspec.msgpack.Encoder()
_bucket_decoder = msgspec.msgpack.Decoder(dict[str, bytes])
_pack_decoder = msgspec.msgpack.Decoder(list[bytes])


class Meta(msgspec.Struct):
    alive_at: float
    clean: bool = False


_meta_decoder = msgspec.msgpack.Decoder(Meta)


class Deposed(StoreError):
    """This replica is no longer the leader: etcd refused its commit (or it was never elected)."""


class EtcdStore:
    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self.prefix = settings.prefix
        self.leader_key = settings.prefix + "leader"
        self._jobs = settings.prefix + "jobs/"
        self._client = EtcdClient(settings)
        self.fence: int | None = None        # create revision of our election key while we lead
        self.on_deposed: Callable[[], object] | None = None   # called (from the store thread) on a refusal
        self._buckets: dict[str, Buckets] = {}
        self._packs: dict[str, list[int]] = {}     # job -> first event number of each pack, ascending

    @property
    def where(self) -> str:
        return f"etcd store {self.settings.describe()}"

    def describe_failure(self, exc: BaseException) -> str:
        return f"{self.settings.describe()}: {exc}"

    # ---- reading ----

    def load(self) -> Loaded:
        try:
            kvs, revision = self._client.range(self._jobs, prefix_end(self._jobs))
            meta_kvs, _ = self._client.range(self.prefix + "meta", revision=revision)
        except (EtcdUnavailable, EtcdRefused) as exc:
            raise StoreError(f"cannot read {self.where}: {exc}") from None
        by_job: dict[str, list[KeyValue]] = {}
        for kv in kvs:
            by_job.setdefault(kv.key[len(self._jobs):].split("/", 1)[0], []).append(kv)
        self._buckets.clear()
        self._packs.clear()
        jobs = {job_id: job for job_id, rows in by_job.items() if (job := self._assemble(job_id, rows)) is not None}
        meta = self._decode("meta", meta_kvs[0].value, _meta_decoder) if meta_kvs else None
        return Loaded(jobs, meta.alive_at if meta else None, bool(meta and meta.clean))

    def load_job(self, job_id: str) -> JobRecord | None:
        start = f"{self._jobs}{job_id}/"
        kvs, _ = self._client.range(start, prefix_end(start))
        self._buckets.pop(job_id, None)
        self._packs.pop(job_id, None)
        return self._assemble(job_id, kvs)

    def _assemble(self, job_id: str, kvs: list[KeyValue]) -> JobRecord | None:
        row: bytes | None = None
        buckets: Buckets = {}
        events: list[bytes] = []
        packs: list[int] = []
        start = f"{self._jobs}{job_id}/"
        for kv in kvs:                      # in key order: e/ packs by first event number
            kind, _, rest = kv.key[len(start):].partition("/")
            if kind == "row":
                row = kv.value
            elif kind == "n":
                buckets[int(rest, 16)] = self._decode(kv.key, kv.value, _bucket_decoder)
            elif kind == "e":
                pack: list[bytes] = self._decode(kv.key, kv.value, _pack_decoder)
                events.extend(pack)
                packs.append(int(rest))
        if row is None:
            return None
        job = self._decode(start + "row", row, job_decoder)
        nodes = [self._decode(f"{start}n/ node {nid}", blob, node_decoder)
                 for rows in buckets.values() for nid, blob in rows.items()]
        decoded = (self._decode(start + "e/", blob, event_decoder) for blob in events[-2 * MAX_EVENTS_PER_JOB:])
        kept = [e for e in decoded if e.seq <= job.event_seq]
        self._buckets[job_id] = buckets
        self._packs[job_id] = packs
        return assemble(job, nodes, kept[-MAX_EVENTS_PER_JOB:])

    def _decode(self, key: str, blob: bytes, decoder: msgspec.msgpack.Decoder[T]) -> T:
        try:
            return decoder.decode(blob)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise StoreError(f"{self.where}: key {key} is unreadable ({exc}); refusing to start: delete the "
                             "deployment's keys (etcdctl del --prefix) to start with an empty state") from None

    # ---- writing ----

    def write(self, snapshots: list[JobSnapshot], alive_at: float, deleted: Collection[str] = ()) -> None:
        """Commit in as few fenced transactions as etcd's limits allow, never splitting a job."""
        fence = self.fence                  # fixed for the whole batch: a new term never commits an old one's
        if fence is None:
            raise Deposed("this replica is not the leader: it commits nothing")
        max_ops = self.settings.max_txn_ops - 1            # one op is the liveness mark
        max_bytes = self.settings.max_request_bytes - REQUEST_MARGIN
        parts: list[tuple[list[dict[str, Any]], dict[str, tuple[Buckets, list[int]] | None]]] = [([], {})]
        size = 0
        writing = {s.job_id for s in snapshots}
        for job_id in deleted:
            if job_id not in writing:        # a new run of a forgotten id resets its rows instead
                start = f"{self._jobs}{job_id}/"
                parts[0][0].append(delete(start, prefix_end(start)))
                parts[0][1][job_id] = None
        for s in snapshots:
            ops, nbytes, after = self._job_ops(s)
            if len(ops) > max_ops or nbytes > max_bytes:
                raise StoreError(f"job {s.job_id!r}: one commit of {len(ops)} operations and {nbytes} bytes "
                                 f"exceeds what etcd takes in one transaction (--max-txn-ops "
                                 f"{self.settings.max_txn_ops}, --max-request-bytes {self.settings.max_request_bytes})")
            if parts[-1][0] and (len(parts[-1][0]) + len(ops) > max_ops or size + nbytes > max_bytes):
                parts.append(([], {}))
                size = 0
            parts[-1][0].extend(ops)
            parts[-1][1][s.job_id] = after
            size += nbytes
        parts[-1][0].append(put(self.prefix + "meta", _encoder.encode(Meta(alive_at))))
        for ops, updates in parts:
            self._commit(fence, ops)
            for job_id, done in updates.items():
                if done is None:
                    self._buckets.pop(job_id, None)
                    self._packs.pop(job_id, None)
                else:
                    self._buckets[job_id], self._packs[job_id] = done

    def _commit(self, fence: int, ops: list[dict[str, Any]]) -> None:
        ok, _ = self._client.txn([created_at(self.leader_key, fence)], ops)
        if not ok:
            self.fence = None
            if self.on_deposed is not None:
                self.on_deposed()
            raise Deposed(f"commit refused: the election key {self.leader_key} is no longer this replica's "
                          f"(created at revision {fence}): another replica leads")

    def _job_ops(self, s: JobSnapshot) -> tuple[list[dict[str, Any]], int, tuple[Buckets, list[int]]]:
        """One job's operations, their size, and its node buckets and event packs once committed."""
        start = f"{self._jobs}{s.job_id}/"
        ops = [put(start + "row", s.record)]
        committed: Buckets = {} if s.reset else self._committed(s.job_id)
        touched, nbytes = self._node_ops(s, start, committed, ops)
        packs, event_bytes = self._event_ops(s, start, ops)
        after = {b: rows for b, rows in {**committed, **touched}.items() if rows}
        return ops, len(s.record) + nbytes + event_bytes, (after, packs)

    @staticmethod
    def _node_ops(s: JobSnapshot, start: str, committed: Buckets, ops: list[dict[str, Any]]) -> tuple[Buckets, int]:
        """The node buckets a job's changed nodes touch, as operations (appended to `ops`); their size."""
        touched: Buckets = {}
        nbytes = 0
        for nid, blob in s.nodes.items():
            b = zlib.crc32(nid.encode()) % NODE_BUCKETS        # its bucket: by node-id hash
            rows = touched.get(b)
            if rows is None:
                rows = touched[b] = dict(committed.get(b, {}))
            if blob is None:
                rows.pop(nid, None)
            else:
                rows[nid] = blob
        written = {b for b, rows in touched.items() if rows}
        for b in sorted(touched):
            key = f"{start}n/{b:02x}"
            if touched[b]:
                encoded = _encoder.encode(touched[b])
                ops.append(put(key, encoded))
                nbytes += len(encoded)
            elif not s.reset:
                ops.append(delete(key))
        if s.reset:     # the old run's other buckets go: a range per run of buckets not written
            edges = [-1, *sorted(written), NODE_BUCKETS]
            for before, after in zip(edges, edges[1:], strict=False):
                if after - before > 1:
                    ops.append(delete(f"{start}n/{before + 1:02x}", f"{start}n/{after:02x}" if after < NODE_BUCKETS
                                      else prefix_end(f"{start}n/")))
        return touched, nbytes

    def _event_ops(self, s: JobSnapshot, start: str, ops: list[dict[str, Any]]) -> tuple[list[int], int]:
        """The job's new events as one pack, and the old packs to delete (appended to `ops`); the packs
        kept once committed, and the pack's size."""
        events = f"{start}e/"
        packs = [] if s.reset else list(self._pack_starts(s.job_id))
        pack_key, nbytes = None, 0
        if s.events:
            pack_key = f"{events}{s.events[0][0]:012d}"
            pack = _encoder.encode([blob for _, blob in s.events])
            ops.append(put(pack_key, pack))
            nbytes = len(pack)
            packs.append(s.events[0][0])
        if s.reset:     # the old run's history goes, around the new run's first pack
            ops.extend([delete(events, pack_key), delete(pack_key + "\0", prefix_end(events))] if pack_key
                       else [delete(events, prefix_end(events))])
        elif s.events:
            # a pack is wholly older than the kept history when the next one starts at or before keep_after + 1
            old = 0
            while old + 1 < len(packs) and packs[old + 1] <= s.keep_after_seq + 1:
                old += 1
            if old:
                ops.append(delete(events, f"{events}{packs[old]:012d}"))
                packs = packs[old:]
        return packs, nbytes

    def _pack_starts(self, job_id: str) -> list[int]:
        """The first event numbers of the job's packs (read once when this replica has not loaded them)."""
        packs = self._packs.get(job_id)
        if packs is None:
            start = f"{self._jobs}{job_id}/e/"
            kvs, _ = self._client.range(start, prefix_end(start), keys_only=True)
            packs = self._packs[job_id] = [int(kv.key[len(start):]) for kv in kvs]
        return packs

    def _committed(self, job_id: str) -> Buckets:
        """The job's node buckets as committed (read once when this replica has not loaded them)."""
        buckets = self._buckets.get(job_id)
        if buckets is None:
            start = f"{self._jobs}{job_id}/n/"
            kvs, _ = self._client.range(start, prefix_end(start))
            buckets = {int(kv.key[len(start):], 16): self._decode(kv.key, kv.value, _bucket_decoder) for kv in kvs}
            self._buckets[job_id] = buckets
        return buckets

    def close(self, now: float) -> None:
        """Mark a clean shutdown (while still the leader) and let go of the connections."""
        try:
            if self.fence is not None:
                self._commit(self.fence, [put(self.prefix + "meta", _encoder.encode(Meta(now, clean=True)))])
        finally:
            self.release()

    def release(self) -> None:
        self._client.close()
