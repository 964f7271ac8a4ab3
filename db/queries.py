"""The queries the CLI, search, export and dashboard share.

Typed values go in (GpuSpec, Problem, Measurement) and dataclasses / dicts come out, so callers
never hold ORM objects beyond a session. Nothing here commits: the caller owns the transaction.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Select, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..gpu import GpuSpec
from ..peers import PEER_FAMILIES  # torch's SDPA backends, measured as configs of these families, params {}
from ..problem import Problem
from ..records import STATUSES, Measurement, Resources, params_key, versions_key
from .models import BestRow, ConfigRow, GpuRow, MeasurementRow, ProblemRow, utcnow

R = TypeVar("R")


@dataclass(frozen=True)
class BestEntry:
    gpu_key: str
    family: str
    problem: Problem
    bucket_key: str
    params: dict = field(hash=False)
    tflops: float
    median_ms: float
    measurement_id: int


@dataclass(frozen=True)
class PeerSummary:
    family: str
    tflops: float | None
    median_ms: float | None
    measurement_id: int
    run_id: str | None
    created_at: datetime


@dataclass(frozen=True)
class GpuInfo:
    key: str
    name: str
    cc: str
    sm_count: int
    spec: dict = field(hash=False)
    first_seen: datetime | None = None


def _get_or_create(s: Session, query: Select[tuple[R]], make: Callable[[], R]) -> R:
    """Select, else insert inside a SAVEPOINT; a concurrent insert of the same key wins cleanly."""
    row = s.scalar(query)
    if row is not None:
        return row
    try:
        with s.begin_nested():
            row = make()
            s.add(row)
    except IntegrityError:
        row = s.scalar(query)
        if row is None:  # the conflict was something other than our unique key
            raise
    return row


def upsert_gpu(s: Session, gpu: GpuSpec) -> GpuRow:
    return _get_or_create(
        s,
        select(GpuRow).where(GpuRow.key == gpu.key),
        lambda: GpuRow(
            key=gpu.key, name=gpu.name, cc=gpu.cc, sm_count=gpu.sm_count,
            spec_json=json.dumps(gpu.to_dict(), sort_keys=True), first_seen=utcnow(),
        ),
    )


def upsert_problem(s: Session, p: Problem) -> ProblemRow:
    return _get_or_create(
        s,
        select(ProblemRow).where(ProblemRow.key == p.key),
        lambda: ProblemRow(
            key=p.key, batch=p.batch, heads=p.heads, kv_heads=p.kv_heads, seqlen_q=p.seqlen_q,
            seqlen_k=p.seqlen_k, head_dim=p.head_dim, dtype=p.dtype, causal=p.causal,
            mask=p.mask, max_error=p.max_error, bucket_key=p.bucket().key,
        ),
    )


def upsert_config(s: Session, family: str, params: dict) -> ConfigRow:
    text = params_key(params)
    return _get_or_create(
        s,
        select(ConfigRow).where(ConfigRow.family == family, ConfigRow.params_json == text),
        lambda: ConfigRow(family=family, params_json=text),
    )


def record_measurement(
    s: Session,
    gpu: GpuSpec,
    problem: Problem,
    family: str,
    params: dict,
    m: Measurement,
    *,
    study_name: str | None = None,
    trial_number: int | None = None,
    run_id: str | None = None,
) -> MeasurementRow:
    """Store one measurement (failures too); flushed so its id is known, not committed."""
    if m.status not in STATUSES:
        raise ValueError(f"unknown measurement status {m.status!r}")
    g, p, c = upsert_gpu(s, gpu), upsert_problem(s, problem), upsert_config(s, family, params)
    r = m.resources
    row = MeasurementRow(
        gpu_id=g.id, problem_id=p.id, config_id=c.id, status=m.status,
        median_ms=m.median_ms, min_ms=m.min_ms, max_ms=m.max_ms, tflops=m.tflops,
        max_abs_err=m.max_abs_err, rel_err=m.rel_err, lse_err=m.lse_err,
        registers=r.registers, spill_bytes=r.spill_bytes, stack_bytes=r.stack_bytes,
        static_smem=r.static_smem, dynamic_smem=r.dynamic_smem,
        compile_seconds=m.compile_seconds, reps=m.reps,
        versions_json=params_key(m.versions), versions_key=versions_key(m.versions),
        message=m.message, study_name=study_name, trial_number=trial_number, run_id=run_id,
        created_at=utcnow(),
    )
    s.add(row)
    s.flush()
    return row


def _to_measurement(row: MeasurementRow) -> Measurement:
    return Measurement(
        status=row.status, median_ms=row.median_ms, min_ms=row.min_ms, max_ms=row.max_ms,
        tflops=row.tflops, max_abs_err=row.max_abs_err, rel_err=row.rel_err, lse_err=row.lse_err,
        resources=Resources(row.registers, row.spill_bytes, row.stack_bytes, row.static_smem, row.dynamic_smem),
        compile_seconds=row.compile_seconds, versions=json.loads(row.versions_json or "{}"),
        message=row.message or "", reps=row.reps,
    )


def _to_problem(row: ProblemRow) -> Problem:
    """The row's problem. Its bucket is `.bucket()` under today's rule: the stored bucket_key is the
    rule of the flashtune that wrote the row (a one-query bottom-right step was filed as causal_br
    before problem.seen_mask), so best entries take the problem's own."""
    return Problem(row.batch, row.heads, row.seqlen_q, row.seqlen_k, row.head_dim, row.dtype,
                   row.mask, row.kv_heads, row.max_error or 0.0)


def _joined() -> Select[tuple[MeasurementRow]]:
    return (
        select(MeasurementRow)
        .join(GpuRow, MeasurementRow.gpu_id == GpuRow.id)
        .join(ProblemRow, MeasurementRow.problem_id == ProblemRow.id)
        .join(ConfigRow, MeasurementRow.config_id == ConfigRow.id)
    )


def find_measurement(
    s: Session, gpu_key: str, problem_key: str, family: str, params: dict, versions_key: str | None
) -> Measurement | None:
    """The latest stored measurement of exactly this point under these versions (None: any
    versions, as a replay asks), of any status: one indexed query, whatever the database holds.

    Every status answers, crash and timeout included: the caller decides whether a failure is
    worth retrying (e.g. `--retry-failed`); by default a point measured once is not measured again.
    """
    where = [GpuRow.key == gpu_key, ProblemRow.key == problem_key, ConfigRow.family == family,
             ConfigRow.params_json == params_key(params)]
    if versions_key is not None:
        where.append(MeasurementRow.versions_key == versions_key)
    row = s.scalar(
        _joined().where(*where).order_by(MeasurementRow.created_at.desc(), MeasurementRow.id.desc()).limit(1)
    )
    return None if row is None else _to_measurement(row)


def record_peers(s: Session, gpu: GpuSpec, problem: Problem, peers: dict[str, Measurement],
                 run_id: str | None = None) -> None:
    """Store the SDPA peers measured for `problem` (each as a config {} of its family)."""
    for backend, m in peers.items():
        record_measurement(s, gpu, problem, backend, {}, m, run_id=run_id)


def update_best(s: Session, gpu_key: str, problem_key: str, family: str) -> BestRow | None:
    """Recompute the winner of one (GPU, problem, family) from its ok rows: highest TFLOP/s.

    Ties go to the lower median, then the earlier row. With no ok row left, the best row goes.
    """
    g = s.scalar(select(GpuRow).where(GpuRow.key == gpu_key))
    p = s.scalar(select(ProblemRow).where(ProblemRow.key == problem_key))
    if g is None or p is None:
        return None
    win = s.scalar(
        select(MeasurementRow)
        .join(ConfigRow, MeasurementRow.config_id == ConfigRow.id)
        .where(
            MeasurementRow.gpu_id == g.id, MeasurementRow.problem_id == p.id,
            ConfigRow.family == family, MeasurementRow.status == "ok",
            MeasurementRow.tflops.is_not(None), MeasurementRow.median_ms.is_not(None),
        )
        .order_by(MeasurementRow.tflops.desc(), MeasurementRow.median_ms.asc(), MeasurementRow.id.asc())
        .limit(1)
    )
    query = select(BestRow).where(BestRow.gpu_id == g.id, BestRow.problem_id == p.id, BestRow.family == family)
    if win is None:
        old = s.scalar(query)
        if old is not None:
            s.delete(old)
            s.flush()
        return None
    assert win.tflops is not None and win.median_ms is not None
    best = _get_or_create(
        s, query,
        lambda: BestRow(
            gpu_id=g.id, problem_id=p.id, family=family, config_id=win.config_id,
            measurement_id=win.id, bucket_key=p.bucket_key, tflops=win.tflops,
            median_ms=win.median_ms, updated_at=utcnow(),
        ),
    )
    if best.measurement_id != win.id:
        best.config_id, best.measurement_id = win.config_id, win.id
        best.tflops, best.median_ms, best.bucket_key = win.tflops, win.median_ms, p.bucket_key
        best.updated_at = utcnow()
    s.flush()
    return best


def best_row(s: Session, gpu_key: str, family: str, problem_key: str) -> BestEntry | None:
    """The stored best of one (GPU, family, problem), found by the database, not by reading them all."""
    rows = best_rows(s, gpu_key, family=family, problem_key=problem_key)
    return rows[0] if rows else None


def best_rows(s: Session, gpu_key: str | None = None, *, family: str | None = None,
              problem_key: str | None = None) -> list[BestEntry]:
    q = (
        select(BestRow, GpuRow, ProblemRow, ConfigRow)
        .join(GpuRow, BestRow.gpu_id == GpuRow.id)
        .join(ProblemRow, BestRow.problem_id == ProblemRow.id)
        .join(ConfigRow, BestRow.config_id == ConfigRow.id)
        .order_by(GpuRow.key, BestRow.family, ProblemRow.key)
    )
    if gpu_key is not None:
        q = q.where(GpuRow.key == gpu_key)
    if family is not None:
        q = q.where(BestRow.family == family)
    if problem_key is not None:
        q = q.where(ProblemRow.key == problem_key)
    out = []
    for b, g, p, c in s.execute(q):
        problem = _to_problem(p)
        out.append(BestEntry(
            gpu_key=g.key, family=b.family, problem=problem, bucket_key=problem.bucket().key,
            params=json.loads(c.params_json), tflops=b.tflops, median_ms=b.median_ms,
            measurement_id=b.measurement_id,
        ))
    return out


def peer_rows(s: Session, gpu_key: str, problem_key: str, run_id: str | None = None) -> dict[str, PeerSummary]:
    """Latest ok measurement of each torch SDPA backend for one problem (optionally one run)."""
    q = (
        _joined()
        .add_columns(ConfigRow.family)
        .where(
            GpuRow.key == gpu_key, ProblemRow.key == problem_key,
            ConfigRow.family.in_(PEER_FAMILIES), MeasurementRow.status == "ok",
        )
        .order_by(MeasurementRow.created_at.desc(), MeasurementRow.id.desc())
    )
    if run_id is not None:
        q = q.where(MeasurementRow.run_id == run_id)
    out: dict[str, PeerSummary] = {}
    for row, family in s.execute(q):
        if family not in out:
            out[family] = PeerSummary(family, row.tflops, row.median_ms, row.id, row.run_id, row.created_at)
    return out


def peer_best_rows(s: Session, gpu_key: str | None = None, families: tuple[str, ...] = PEER_FAMILIES) -> list[BestEntry]:
    """The latest ok measurement of each peer family per (GPU, problem), as best entries (params {}):
    a peer has one config, and its latest timing is the one taken under today's torch."""
    q = (
        _joined()
        .add_columns(GpuRow.key, ConfigRow.family, ProblemRow)
        .where(ConfigRow.family.in_(families), MeasurementRow.status == "ok", MeasurementRow.tflops.is_not(None),
               MeasurementRow.median_ms.is_not(None))
        .order_by(MeasurementRow.created_at.desc(), MeasurementRow.id.desc())
    )
    if gpu_key is not None:
        q = q.where(GpuRow.key == gpu_key)
    out: dict[tuple[str, int, str], BestEntry] = {}
    for row, key, family, p in s.execute(q):
        slot = (key, p.id, family)
        if slot not in out:
            problem = _to_problem(p)
            out[slot] = BestEntry(gpu_key=key, family=family, problem=problem, bucket_key=problem.bucket().key,
                                  params={}, tflops=row.tflops, median_ms=row.median_ms, measurement_id=row.id)
    return list(out.values())


def status_counts(s: Session, gpu_key: str | None = None, family: str | None = None) -> dict[str, int]:
    """Count per status; every status word is present (0 where none) so tables line up."""
    q = (
        select(MeasurementRow.status, func.count(MeasurementRow.id))
        .join(GpuRow, MeasurementRow.gpu_id == GpuRow.id)
        .join(ConfigRow, MeasurementRow.config_id == ConfigRow.id)
        .group_by(MeasurementRow.status)
    )
    if gpu_key is not None:
        q = q.where(GpuRow.key == gpu_key)
    if family is not None:
        q = q.where(ConfigRow.family == family)
    counts = dict.fromkeys(STATUSES, 0)
    for status, n in s.execute(q):
        counts[status] = n
    return counts


_PROBLEM_FIELDS = ("batch", "heads", "kv_heads", "seqlen_q", "seqlen_k", "head_dim", "dtype", "causal", "mask")
_ROW_FIELDS = (
    "status", "median_ms", "min_ms", "max_ms", "tflops", "max_abs_err", "rel_err", "lse_err",
    "registers", "spill_bytes", "stack_bytes", "static_smem", "dynamic_smem", "compile_seconds",
    "reps", "versions_key", "message", "study_name", "trial_number", "run_id", "created_at",
)


def measurements(
    s: Session, gpu_key: str | None = None, family: str | None = None, problem_key: str | None = None
) -> list[dict[str, Any]]:
    """Flat rows for the dashboard (one DataFrame away); each param also appears as `p_<name>`."""
    q = (
        select(MeasurementRow, GpuRow, ProblemRow, ConfigRow)
        .join(GpuRow, MeasurementRow.gpu_id == GpuRow.id)
        .join(ProblemRow, MeasurementRow.problem_id == ProblemRow.id)
        .join(ConfigRow, MeasurementRow.config_id == ConfigRow.id)
        .order_by(MeasurementRow.id)
    )
    if gpu_key is not None:
        q = q.where(GpuRow.key == gpu_key)
    if family is not None:
        q = q.where(ConfigRow.family == family)
    if problem_key is not None:
        q = q.where(ProblemRow.key == problem_key)
    out: list[dict[str, Any]] = []
    for m, g, p, c in s.execute(q):
        params = json.loads(c.params_json)
        d: dict[str, Any] = {"id": m.id, "gpu_key": g.key, "gpu_name": g.name, "problem_key": p.key,
                             "bucket_key": p.bucket_key, "family": c.family,
                             "params_key": c.params_json, "params": params}
        d.update({f: getattr(p, f) for f in _PROBLEM_FIELDS})
        d.update({f: getattr(m, f) for f in _ROW_FIELDS})
        d.update({f"p_{k}": v for k, v in params.items()})
        out.append(d)
    return out


def list_gpus(s: Session) -> list[GpuInfo]:
    return [
        GpuInfo(g.key, g.name, g.cc, g.sm_count, json.loads(g.spec_json), g.first_seen)
        for g in s.scalars(select(GpuRow).order_by(GpuRow.key))
    ]


def measured_families(s: Session, gpu_key: str, problem_key: str) -> set[str]:
    """The kernel families (and SDPA peers) with any measurement of one problem on one GPU."""
    q = (
        select(ConfigRow.family).distinct()
        .join(MeasurementRow, MeasurementRow.config_id == ConfigRow.id)
        .join(GpuRow, MeasurementRow.gpu_id == GpuRow.id)
        .join(ProblemRow, MeasurementRow.problem_id == ProblemRow.id)
        .where(GpuRow.key == gpu_key, ProblemRow.key == problem_key)
    )
    return set(s.scalars(q))


def list_problems(s: Session, gpu_key: str | None = None) -> list[Problem]:
    """All known problems, or those measured on one GPU."""
    q = select(ProblemRow).order_by(ProblemRow.key)
    if gpu_key is not None:
        measured = (
            select(MeasurementRow.problem_id)
            .join(GpuRow, MeasurementRow.gpu_id == GpuRow.id)
            .where(GpuRow.key == gpu_key)
        )
        q = q.where(ProblemRow.id.in_(measured))
    return [_to_problem(p) for p in s.scalars(q)]


def study_summaries(s: Session) -> list[dict[str, Any]]:
    """Trial counts per (GPU, family, problem, status), aggregated in SQL.

    The dashboard's overview reads this instead of `measurements()`, so a database of 100,000
    rows opens in well under a second: no ORM objects, no JSON parsing per row.
    """
    q = (
        select(
            GpuRow.key, GpuRow.name, ConfigRow.family, ProblemRow.key, ProblemRow.bucket_key,
            *(getattr(ProblemRow, f) for f in _PROBLEM_FIELDS),
            MeasurementRow.status, func.count(MeasurementRow.id), func.max(MeasurementRow.tflops),
            func.max(MeasurementRow.created_at),
        )
        .join(GpuRow, MeasurementRow.gpu_id == GpuRow.id)
        .join(ProblemRow, MeasurementRow.problem_id == ProblemRow.id)
        .join(ConfigRow, MeasurementRow.config_id == ConfigRow.id)
        .group_by(GpuRow.id, ConfigRow.family, ProblemRow.id, MeasurementRow.status)
        .order_by(GpuRow.key, ConfigRow.family, ProblemRow.key, MeasurementRow.status)
    )
    names = ("gpu_key", "gpu_name", "family", "problem_key", "bucket_key", *_PROBLEM_FIELDS,
             "status", "count", "max_tflops", "last_at")
    return [dict(zip(names, row)) for row in s.execute(q)]


def recent_trials(s: Session, since: datetime) -> list[dict[str, Any]]:
    """Search trials stored since `since` (rows with a study name; peers have none), oldest first:
    what a live view counts per minute (only the window's rows leave the database)."""
    q = (
        select(MeasurementRow.study_name, GpuRow.key, ConfigRow.family, ProblemRow.key,
               MeasurementRow.trial_number, MeasurementRow.status, MeasurementRow.tflops,
               MeasurementRow.created_at)
        .join(GpuRow, MeasurementRow.gpu_id == GpuRow.id)
        .join(ProblemRow, MeasurementRow.problem_id == ProblemRow.id)
        .join(ConfigRow, MeasurementRow.config_id == ConfigRow.id)
        .where(MeasurementRow.created_at >= since, MeasurementRow.study_name.is_not(None))
        .order_by(MeasurementRow.created_at, MeasurementRow.id)
    )
    names = ("study_name", "gpu_key", "family", "problem_key", "trial_number", "status", "tflops", "created_at")
    return [dict(zip(names, row)) for row in s.execute(q)]
