"""The Redis backend of the job store, for router replicas and model groups on several nodes.

Keys (under the configured prefix): ``job:<id>`` the record as JSON; ``jobs`` a sorted set of ids
scored by creation sequence (``seq`` from ``INCR``); ``file:<name>`` a hash (data, media type)
expiring with its job; ``owner:<id>`` a key that lives ``lease_s`` after a model group's last
heartbeat; ``active:<tenant>`` a set of the tenant's job ids (pruned of finished ones when
counted); ``epoch`` the store's epoch. Read-modify-write of a record is an optimistic
transaction (``WATCH``/``MULTI``), retried when another client changed the record in between.

Every call has ``timeout_s`` to answer (connect and read), so a paused or dead Redis costs a
caller at most that, and shows as a store fault (``redis.TimeoutError`` / ``ConnectionError``).

Persistence: jobs are only as durable as Redis keeps them. A deployment that must keep its
jobs across a Redis restart runs Redis with ``appendonly yes`` (``appendfsync everysec`` loses
at most a second); without it a restart comes back empty, which the store notices (a new
``epoch``): model groups write back the jobs they hold and the rest answer as lost, not as
"never existed" (``docs/tenancy.md``).
"""

from __future__ import annotations

import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from xema_ray.serving.jobs.store import JobRecord, JobStore, JobStoreConfig, TenantBusy, Update, _active, new_epoch, read_record


class RedisJobStore(JobStore):
    """Same semantics as ``SQLiteJobStore``; results are kept in Redis (they expire with the job)."""

    def __init__(self, cfg: JobStoreConfig) -> None:
        super().__init__(cfg)
        assert cfg.redis_url is not None  # checked by JobStoreConfig
        # one retry on a dead connection only: a pooled socket the server closed (it restarted) is
        # reconnected instead of failing the request; a store that does not answer (a timeout) is
        # not retried, so a paused store still costs at most timeout_s before the 503
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        self.r = redis.Redis.from_url(cfg.redis_url, socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.timeout_s,
                                      retry=retry)
        self.p = cfg.prefix

    def _k(self, *parts: str) -> str:
        return ":".join((self.p, *parts))

    def _insert(self, rec: JobRecord, max_active: int | None) -> JobRecord:
        seq = int(self.r.incr(self._k("seq")))
        rec = rec.model_copy(update={"seq": seq})
        active_key = self._k("active", rec.tenant or "-")
        with self.r.pipeline(transaction=True) as p:
            while True:
                try:
                    # watching the tenant's set makes two concurrent creates of one tenant conflict:
                    # the second re-counts, so the limit holds across router replicas
                    p.watch(active_key)
                    if max_active is not None:
                        members = [m.decode() for m in p.smembers(active_key)]
                        raws = p.mget([self._k("job", m) for m in members]) if members else []
                        # a record this version cannot read (another version's) still counts as active
                        done = [m for m, raw in zip(members, raws, strict=True)
                                if raw is None or ((old := read_record(raw, m)) is not None and not _active(old))]
                        if len(members) - len(done) >= max_active:
                            p.unwatch()
                            raise TenantBusy(rec.tenant, len(members) - len(done))
                    p.multi()
                    if max_active is not None and done:
                        p.srem(active_key, *done)
                    p.set(self._k("job", rec.id), rec.model_dump_json())
                    p.zadd(self._k("jobs"), {rec.id: seq})
                    p.sadd(active_key, rec.id)
                    p.execute()
                    return rec
                except redis.WatchError:
                    continue

    def epoch(self) -> str:
        self.r.set(self._k("epoch"), new_epoch(), nx=True)
        return bytes(self.r.get(self._k("epoch")) or b"").decode()

    def restore(self, rec: JobRecord) -> bool:
        if not self.r.set(self._k("job", rec.id), rec.model_dump_json(), nx=True):
            return False
        seq = int(self.r.incr(self._k("seq")))
        self.r.zadd(self._k("jobs"), {rec.id: seq})
        self.r.sadd(self._k("active", rec.tenant or "-"), rec.id)
        self._update(rec.id, lambda r: r.model_copy(update={"seq": seq}))
        return True

    def delete_files_of(self, job_id: str) -> None:
        keys = list(self.r.scan_iter(match=self._k("file", job_id) + ".*", count=100))
        if keys:
            self.r.delete(*keys)

    def _load(self, job_id: str) -> JobRecord | None:
        raw = self.r.get(self._k("job", job_id))
        return read_record(raw, job_id) if raw else None

    def _update(self, job_id: str, fn: Update) -> JobRecord | None:
        key = self._k("job", job_id)
        with self.r.pipeline(transaction=True) as p:
            while True:
                try:
                    p.watch(key)
                    raw = p.get(key)
                    rec = read_record(raw, job_id) if raw else None
                    new = fn(rec) if rec is not None else None
                    if new is None:
                        p.unwatch()
                        return None
                    p.multi()
                    p.set(key, new.model_dump_json())
                    p.execute()
                    return new
                except redis.WatchError:
                    continue  # another client wrote the record first: read it again

    def _scan(self, after_seq: int | None, limit: int, descending: bool) -> list[JobRecord]:
        zkey = self._k("jobs")
        while True:  # past pages of nothing but expired or unreadable ids
            if descending:
                hi = f"({after_seq}" if after_seq is not None else "+inf"
                scored = self.r.zrevrangebyscore(zkey, hi, "-inf", start=0, num=limit, withscores=True)
            else:
                lo = f"({after_seq}" if after_seq is not None else "-inf"
                scored = self.r.zrangebyscore(zkey, lo, "+inf", start=0, num=limit, withscores=True)
            if not scored:
                return []
            ids = [i for i, _ in scored]
            raws = self.r.mget([self._k("job", i.decode()) for i in ids])
            out, gone = [], []
            for i, raw in zip(ids, raws, strict=True):
                if raw is None:
                    gone.append(i)  # expired by Redis: drop it from the index too
                elif (rec := read_record(raw, i.decode())) is not None:
                    out.append(rec)
            if gone:
                self.r.zrem(zkey, *gone)
            if out:
                return out
            after_seq = int(scored[-1][1])

    def _remove(self, job_id: str) -> None:
        with self.r.pipeline(transaction=True) as p:
            p.delete(self._k("job", job_id))
            p.zrem(self._k("jobs"), job_id)
            p.execute()

    def _expire_record(self, rec: JobRecord | None) -> None:
        if rec is not None and rec.expires_at is not None:
            self.r.pexpireat(self._k("job", rec.id), int(rec.expires_at * 1000) + 1)

    def put_file(self, name: str, data: bytes, media_type: str, expires_at: float) -> None:
        key = self._k("file", name)
        with self.r.pipeline(transaction=True) as p:
            p.hset(key, mapping={"data": data, "media_type": media_type})
            p.pexpireat(key, int(expires_at * 1000) + 1)
            p.execute()

    def get_file(self, name: str) -> tuple[bytes, str] | None:
        got = self.r.hmget(self._k("file", name), ["data", "media_type"])
        if got[0] is None or got[1] is None:
            return None
        return bytes(got[0]), got[1].decode()

    def delete_file(self, name: str) -> None:
        self.r.delete(self._k("file", name))

    def heartbeat(self, owner: str) -> None:
        self.r.set(self._k("owner", owner), str(time.time()), px=int(self.cfg.lease_s * 1000))

    def owner_alive(self, owner: str) -> bool:
        return bool(self.r.exists(self._k("owner", owner)))

    def _purge_files(self, now: float) -> None:
        pass  # Redis expires files by itself

    # finished and deleted records expire by themselves too
    def complete(self, job_id: str, files: dict[str, tuple[bytes, str]]) -> bool:
        done = super().complete(job_id, files)
        self._expire_record(self._load(job_id))
        return done

    def fail(self, job_id: str, code: str, message: str) -> None:
        super().fail(job_id, code, message)
        self._expire_record(self._load(job_id))

    def delete(self, job_id: str, result_names: tuple[str, ...] = ()) -> JobRecord | None:
        before = super().delete(job_id, result_names)
        self._expire_record(self._load(job_id))
        return before
