"""ORM tables of flashtune's results database.

Every table is prefixed `ft_` because Optuna's RDB storage (studies, trials, ...) lives in the
same database file and must never collide with ours.
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """Stores UTC and reads back timezone-aware datetimes (SQLite otherwise drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value


class Base(DeclarativeBase):
    pass


class MetaRow(Base):
    """One row: the schema version this database was created with."""

    __tablename__ = "ft_meta"

    id: Mapped[int] = mapped_column(primary_key=True)
    schema_version: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class GpuRow(Base):
    __tablename__ = "ft_gpus"

    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(200), unique=True)
    name: Mapped[str] = mapped_column(String(200))
    cc: Mapped[str] = mapped_column(String(16))
    sm_count: Mapped[int] = mapped_column(Integer)
    spec_json: Mapped[str] = mapped_column(Text)
    first_seen: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ProblemRow(Base):
    __tablename__ = "ft_problems"

    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(200), unique=True)
    batch: Mapped[int] = mapped_column(Integer)
    heads: Mapped[int] = mapped_column(Integer)
    kv_heads: Mapped[int] = mapped_column(Integer)
    seqlen_q: Mapped[int] = mapped_column(Integer)
    seqlen_k: Mapped[int] = mapped_column(Integer)
    head_dim: Mapped[int] = mapped_column(Integer)
    dtype: Mapped[str] = mapped_column(String(16))
    causal: Mapped[bool] = mapped_column(Boolean)  # either causal mask (schema 4 keeps it for readers)
    mask: Mapped[str] = mapped_column(String(16), default="none", server_default="none")  # Problem.mask
    max_error: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")  # 0: the dtype's budget
    bucket_key: Mapped[str] = mapped_column(String(100), index=True)


class ConfigRow(Base):
    __tablename__ = "ft_configs"
    __table_args__ = (UniqueConstraint("family", "params_json", name="uq_ft_configs_family_params"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    family: Mapped[str] = mapped_column(String(100), index=True)
    params_json: Mapped[str] = mapped_column(Text)  # canonical: records.params_key


class MeasurementRow(Base):
    __tablename__ = "ft_measurements"
    __table_args__ = (
        Index("ix_ft_measurements_lookup", "gpu_id", "problem_id", "config_id", "versions_key"),
        Index("ix_ft_measurements_study", "study_name", "trial_number"),  # schema version 2
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    gpu_id: Mapped[int] = mapped_column(ForeignKey("ft_gpus.id"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("ft_problems.id"))
    config_id: Mapped[int] = mapped_column(ForeignKey("ft_configs.id"))
    status: Mapped[str] = mapped_column(String(32), index=True)
    median_ms: Mapped[float | None] = mapped_column(Float)
    min_ms: Mapped[float | None] = mapped_column(Float)
    max_ms: Mapped[float | None] = mapped_column(Float)
    tflops: Mapped[float | None] = mapped_column(Float)
    max_abs_err: Mapped[float | None] = mapped_column(Float)
    rel_err: Mapped[float | None] = mapped_column(Float)
    lse_err: Mapped[float | None] = mapped_column(Float)
    registers: Mapped[int] = mapped_column(Integer, default=0)
    spill_bytes: Mapped[int] = mapped_column(Integer, default=0)
    stack_bytes: Mapped[int] = mapped_column(Integer, default=0)
    static_smem: Mapped[int] = mapped_column(Integer, default=0)
    dynamic_smem: Mapped[int] = mapped_column(Integer, default=0)
    compile_seconds: Mapped[float | None] = mapped_column(Float)
    reps: Mapped[int] = mapped_column(Integer, default=0)
    versions_json: Mapped[str] = mapped_column(Text, default="{}")
    versions_key: Mapped[str] = mapped_column(String(64), index=True)
    message: Mapped[str] = mapped_column(Text, default="")
    study_name: Mapped[str | None] = mapped_column(String(300))
    trial_number: Mapped[int | None] = mapped_column(Integer)
    run_id: Mapped[str | None] = mapped_column(String(100), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    gpu: Mapped[GpuRow] = relationship()
    problem: Mapped[ProblemRow] = relationship()
    config: Mapped[ConfigRow] = relationship()


class BestRow(Base):
    """The fastest ok measurement per (GPU, problem, family): what the export is built from."""

    __tablename__ = "ft_best"
    __table_args__ = (
        UniqueConstraint("gpu_id", "problem_id", "family", name="uq_ft_best_gpu_problem_family"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    gpu_id: Mapped[int] = mapped_column(ForeignKey("ft_gpus.id"))
    problem_id: Mapped[int] = mapped_column(ForeignKey("ft_problems.id"))
    family: Mapped[str] = mapped_column(String(100))
    config_id: Mapped[int] = mapped_column(ForeignKey("ft_configs.id"))
    measurement_id: Mapped[int] = mapped_column(ForeignKey("ft_measurements.id"))
    bucket_key: Mapped[str] = mapped_column(String(100), index=True)
    tflops: Mapped[float] = mapped_column(Float)
    median_ms: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)

    gpu: Mapped[GpuRow] = relationship()
    problem: Mapped[ProblemRow] = relationship()
    config: Mapped[ConfigRow] = relationship()


class WorkerRow(Base):
    """One worker process of the fleet (schema version 4): which host, process and GPU it is, and
    when it last beat. A worker whose beat is older than the grace period is lost, and its job
    goes back to the queue."""

    __tablename__ = "ft_workers"

    id: Mapped[int] = mapped_column(primary_key=True)
    host: Mapped[str] = mapped_column(String(200))
    pid: Mapped[int] = mapped_column(Integer)
    gpu_index: Mapped[int] = mapped_column(Integer)
    gpu_key: Mapped[str] = mapped_column(String(200), index=True)
    state: Mapped[str] = mapped_column(String(16), index=True)  # alive, stopped, lost
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    beat_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    jobs_done: Mapped[int] = mapped_column(Integer, default=0)
    trials_done: Mapped[int] = mapped_column(Integer, default=0)


class JobRow(Base):
    """One (GPU model, kernel family, problem) search in the queue (schema version 4). A worker
    of that GPU model claims it under a row lock; `worker_id` and `lease_at` say who holds it."""

    __tablename__ = "ft_jobs"
    __table_args__ = (Index("ix_ft_jobs_claim", "state", "gpu_key", "id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    gpu_key: Mapped[str] = mapped_column(String(200))
    family: Mapped[str] = mapped_column(String(100))
    problem_key: Mapped[str] = mapped_column(String(200))
    problem_json: Mapped[str] = mapped_column(Text)
    trials: Mapped[int] = mapped_column(Integer)
    sampler: Mapped[str] = mapped_column(String(16), default="tpe")
    seed: Mapped[int | None] = mapped_column(Integer)
    peers: Mapped[bool] = mapped_column(Boolean, default=True)
    state: Mapped[str] = mapped_column(String(16))  # queued, running, done, failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker_id: Mapped[int | None] = mapped_column(ForeignKey("ft_workers.id"))
    submitted_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    lease_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    trials_done: Mapped[int] = mapped_column(Integer, default=0)
    best_tflops: Mapped[float | None] = mapped_column(Float)
    message: Mapped[str] = mapped_column(Text, default="")
