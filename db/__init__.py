"""flashtune's results database: models, engine setup and the queries every part shares."""

from .engine import SCHEMA_VERSION, DatabaseError, default_url, make_engine, session_factory
from .models import Base, BestRow, ConfigRow, GpuRow, MeasurementRow, MetaRow, ProblemRow
from .queries import (
    PEER_FAMILIES,
    BestEntry,
    GpuInfo,
    PeerSummary,
    best_rows,
    find_measurement,
    list_gpus,
    list_problems,
    measurements,
    peer_best_rows,
    peer_rows,
    record_measurement,
    status_counts,
    update_best,
    upsert_config,
    upsert_gpu,
    upsert_problem,
)

__all__ = [
    "SCHEMA_VERSION", "DatabaseError", "default_url", "make_engine", "session_factory",
    "Base", "BestRow", "ConfigRow", "GpuRow", "MeasurementRow", "MetaRow", "ProblemRow",
    "PEER_FAMILIES", "BestEntry", "GpuInfo", "PeerSummary", "best_rows", "find_measurement",
    "list_gpus", "list_problems", "measurements", "peer_best_rows", "peer_rows", "record_measurement",
    "status_counts", "update_best", "upsert_config", "upsert_gpu", "upsert_problem",
]
