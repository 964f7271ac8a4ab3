"""Best-config lookup: build, atomic write, strict read."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tuner import export
from tuner.db import BestEntry, make_engine, record_measurement, session_factory, update_best
from tuner.export import (
    SCHEMA,
    SCHEMA_VERSION,
    build_lookup,
    default_lookup_path,
    export_from_db,
    read_lookup,
    write_lookup,
)
from tuner.gpu import A100_SXM, H100_SXM
from tuner.problem import Problem
from tuner.records import Measurement

# P1 and P1b share a bucket (fp16/d64/causal/n1024/medium); P2 is elsewhere
P1 = Problem(8, 12, 1024, 1024, 64, "fp16", True)
P1b = Problem(6, 12, 1000, 1000, 64, "fp16", True)
P2 = Problem(1, 16, 4096, 4096, 128, "bf16", False)


def entry(problem: Problem, family: str, tflops: float, gpu: str = H100_SXM.key, mid: int = 1) -> BestEntry:
    return BestEntry(gpu, family, problem, problem.bucket().key, {"Br": 64, "fam": family}, tflops, 1.0 / tflops, mid)


def sample_doc() -> dict:
    return build_lookup([
        entry(P1, "simt", 50.0), entry(P1b, "simt", 70.0), entry(P1, "wgmma", 200.0),
        entry(P1, "sdpa_flash", 120.0), entry(P2, "simt", 30.0), entry(P1, "simt", 10.0, gpu=A100_SXM.key),
    ])


def test_build_groups_sorted_and_deduped() -> None:
    doc = sample_doc()
    assert doc["schema"] == SCHEMA and doc["version"] == SCHEMA_VERSION and "generated_at" in doc
    h100 = [e for e in doc["entries"] if e["gpu_key"] == H100_SXM.key and e["bucket"] == P1.bucket().key]
    # one per family, fastest first; of the two simt problems in the bucket the one tuned nearer its
    # shape stays (P1, B8 x 12 heads at 1024, against P1b's B6 at 1000), though P1b's ran faster
    assert [(e["family"], e["tflops"]) for e in h100] == [("wgmma", 200.0), ("sdpa_flash", 120.0), ("simt", 50.0)]
    assert h100[2]["problem"] == P1.to_dict()
    assert (h100[0]["dtype"], h100[0]["head_dim"], h100[0]["mask"]) == ("fp16", 64, "causal")
    assert len(doc["entries"]) == 5


def test_write_read_round_trip_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "out" / "best.json"
    doc = sample_doc()
    write_lookup(doc, path)
    write_lookup(doc, path)  # overwriting works too
    assert read_lookup(path) == json.loads(json.dumps(doc))
    assert [p.name for p in path.parent.iterdir()] == ["best.json"]


def test_failed_write_keeps_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "best.json"
    write_lookup(sample_doc(), path)
    before = path.read_bytes()

    def boom(src: str, dst: str) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(export.os, "replace", boom)
    with pytest.raises(OSError, match="disk gone"):
        write_lookup(build_lookup([entry(P2, "simt", 1.0)]), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["best.json"]


def test_write_refuses_invalid_doc(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        write_lookup({"schema": SCHEMA, "version": 1, "entries": [{}]}, tmp_path / "best.json")
    assert list(tmp_path.iterdir()) == []


def _bad(tmp_path: Path, content: str | dict) -> Path:
    p = tmp_path / "bad.json"
    p.write_text(content if isinstance(content, str) else json.dumps(content))
    return p


def _doc_with(**changes) -> dict:
    doc = json.loads(json.dumps(sample_doc()))
    doc.update(changes)
    return doc


def _entry_with(drop: str | None = None, **changes) -> dict:
    doc = json.loads(json.dumps(sample_doc()))
    e = doc["entries"][0]
    e.update(changes)
    if drop:
        del e[drop]
    return doc


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "not a flashtune"),
        ({"schema": "something.else", "version": 1, "entries": []}, "not a flashtune"),
        (_doc_with(version=SCHEMA_VERSION + 1), "written by a newer flashtune"),
        (_doc_with(version="1"), "invalid lookup version"),
        (_doc_with(entries={"a": 1}), "no 'entries' list"),
        (_entry_with(drop="params"), "lacks field 'params'"),
        (_entry_with(drop="bucket"), "lacks field 'bucket'"),
        (_entry_with(tflops="fast"), "'tflops' has type str"),
        (_entry_with(head_dim=True), "'head_dim' has type bool"),
        (_entry_with(mask=1), "'mask' has type int"),
        (_entry_with(mask="sideways"), "unknown mask 'sideways'"),
        (_entry_with(mask="causal_br"), "disagrees with dtype/head_dim/mask"),
        (_entry_with(drop="mask"), "lacks field 'mask'"),
        (_entry_with(bucket="nonsense"), "not a shape-bucket key"),
        (_entry_with(dtype="int8"), "unknown dtype"),
        (_entry_with(problem={"batch": 1}), "entry 0"),
        (_entry_with(head_dim=256), "disagrees"),
    ],
)
def test_read_rejects(tmp_path: Path, content: str | dict, match: str) -> None:
    p = _bad(tmp_path, content)
    with pytest.raises(ValueError, match=match) as info:
        read_lookup(p)
    msg = str(info.value)
    assert str(p) in msg and "\n" not in msg


def test_read_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no best-config lookup"):
        read_lookup(tmp_path / "nope.json")


def test_export_from_db(tmp_path: Path) -> None:
    Session = session_factory(make_engine(f"sqlite:///{tmp_path / 'ft.db'}"))
    ok = lambda t: Measurement("ok", median_ms=10.0 / t, tflops=t)
    with Session() as s, s.begin():
        record_measurement(s, H100_SXM, P1, "simt", {"Br": 32}, ok(40.0))
        record_measurement(s, H100_SXM, P1, "simt", {"Br": 64}, ok(60.0))
        record_measurement(s, H100_SXM, P1, "simt", {"Br": 128}, Measurement("wrong_result", median_ms=0.1, tflops=900.0))
        record_measurement(s, H100_SXM, P1, "sdpa_flash", {}, ok(80.0))
        record_measurement(s, A100_SXM, P2, "simt", {"Br": 16}, ok(20.0))
        for g, p, f in ((H100_SXM, P1, "simt"), (H100_SXM, P1, "sdpa_flash"), (A100_SXM, P2, "simt")):
            update_best(s, g.key, p.key, f)
    out = tmp_path / "best.json"
    with Session() as s:
        assert export_from_db(s, out) == 3
        doc = read_lookup(out)
        h = [e for e in doc["entries"] if e["gpu_key"] == H100_SXM.key]
        assert [(e["family"], e["params"], e["tflops"]) for e in h] == [("sdpa_flash", {}, 80.0), ("simt", {"Br": 64}, 60.0)]
        assert Problem(**h[1]["problem"]) == P1
        before = out.read_bytes()
        with pytest.raises(export.LookupRefused, match="holds 2 entries the new lookup lacks.*--merge.*--force"):
            export_from_db(s, out, gpu_key=A100_SXM.key)  # one GPU's entries would drop the H100's
        assert out.read_bytes() == before
        assert export_from_db(s, out, gpu_key=A100_SXM.key, policy="merge") == 3
        assert export_from_db(s, out, gpu_key=A100_SXM.key, policy="force") == 1
        assert [e["gpu_key"] for e in read_lookup(out)["entries"]] == [A100_SXM.key]


def test_default_lookup_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TUNER_LOOKUP", str(tmp_path / "x.json"))
    assert default_lookup_path() == tmp_path / "x.json"
    monkeypatch.delenv("TUNER_LOOKUP")
    p = default_lookup_path()
    assert p.name == "best.json" and "flashtune" in str(p)


def test_export_module_needs_no_db_or_optuna() -> None:
    code = "import sys, tuner.export; print(sorted(m for m in ('sqlalchemy', 'optuna') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_read_deeply_nested_json_is_one_line(tmp_path: Path) -> None:
    p = _bad(tmp_path, "[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="nested too deeply") as info:
        read_lookup(p)
    assert str(p) in str(info.value) and "\n" not in str(info.value)


# ---- publishing over an existing file: nothing is lost, nothing that is not a lookup is replaced ----

def _good(tmp_path: Path) -> tuple[Path, bytes]:
    path = tmp_path / "best.json"
    write_lookup(sample_doc(), path)
    return path, path.read_bytes()


@pytest.mark.parametrize("policy", export.POLICIES)
@pytest.mark.parametrize("content", [
    b"SQLite format 3\x00" + b"\x00" * 100,  # a results database
    b'{"openapi": "3.0.0"}', b"[1, 2]", b"\xff\xfe not text", b"{truncated",
], ids=["sqlite", "foreign-json", "json-list", "binary", "not-json"])
def test_a_file_that_is_no_lookup_is_never_replaced(tmp_path: Path, content: bytes, policy: str) -> None:
    path = tmp_path / "results.db"
    path.write_bytes(content)
    with pytest.raises(export.LookupRefused, match="refusing to overwrite it") as info:
        export.publish_lookup(sample_doc(), path, policy)
    assert path.read_bytes() == content and "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.db"]


@pytest.mark.parametrize("damage", ["bad-entry", "newer"])
def test_a_damaged_lookup_is_replaced_only_with_force(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "best.json"
    write_lookup(sample_doc(), path)
    text = path.read_text()
    damaged = {"bad-entry": json.dumps({**sample_doc(), "entries": [{"gpu_key": 3}]}),
               "newer": text.replace(f'"version": {SCHEMA_VERSION}', '"version": 7')}[damage].encode()
    path.write_bytes(damaged)
    for policy in ("merge", "complete"):
        with pytest.raises(export.LookupRefused, match="tuner export -o .* --force"):
            export.publish_lookup(sample_doc(), path, policy)
        assert path.read_bytes() == damaged
    export.publish_lookup(sample_doc(), path, "force")
    assert len(read_lookup(path)["entries"]) == 5


def test_complete_refuses_a_lookup_that_serves_less(tmp_path: Path) -> None:
    path, before = _good(tmp_path)
    for fewer in (build_lookup([]), build_lookup([entry(P1, "wgmma", 300.0)])):
        with pytest.raises(export.LookupRefused, match=r"holds \d+ entries the new lookup lacks .*--merge.*--force"):
            export.publish_lookup(fewer, path, "complete")
        assert path.read_bytes() == before
    faster = json.loads(json.dumps(sample_doc()))
    for e in faster["entries"]:
        e["tflops"] += 1.0
    export.publish_lookup(faster, path, "complete")  # at least as complete: written
    assert read_lookup(path)["entries"] == faster["entries"]


def test_merge_keeps_what_the_new_lookup_lacks_and_takes_its_entries(tmp_path: Path) -> None:
    path, _ = _good(tmp_path)
    new = build_lookup([entry(P1, "wgmma", 300.0), entry(P2, "wgmma", 90.0)])
    doc = export.publish_lookup(new, path, "merge")
    got = {(e["bucket"], e["family"], e["gpu_key"]): e["tflops"] for e in read_lookup(path)["entries"]}
    assert doc["entries"] == read_lookup(path)["entries"] and len(got) == 6
    assert got[(P1.bucket().key, "wgmma", H100_SXM.key)] == 300.0  # the new entry for its slot
    assert got[(P2.bucket().key, "wgmma", H100_SXM.key)] == 90.0  # a new slot
    assert got[(P1.bucket().key, "simt", A100_SXM.key)] == 10.0  # the old ones stay
    h100_p1 = [e["family"] for e in read_lookup(path)["entries"]
               if e["gpu_key"] == H100_SXM.key and e["bucket"] == P1.bucket().key]
    assert h100_p1 == ["wgmma", "sdpa_flash", "simt"]  # still fastest first


# Two decode steps of one bucket (bf16/d64/full/n1x8192/large: 32 query heads on 8 K/V heads, B8-B63):
# B16 is the bucket's own work (tuner.nearest.WORK_BH), B32 an octave of work off it. As measured on
# the H200 (PERF_NOTES "h4", us): at B16 the kernel leads, at B32 cuDNN, and B32's figures are higher
# TFLOP/s than B16's whatever runs, since the larger step streams more bytes a microsecond.
DEC16 = Problem(16, 32, 1, 8192, 64, "bf16", "causal_br", kv_heads=8)
DEC32 = Problem(32, 32, 1, 8192, 64, "bf16", "causal_br", kv_heads=8)


def timed(problem: Problem, family: str, us: float) -> BestEntry:
    return BestEntry(H100_SXM.key, family, problem, problem.bucket().key, {"fam": family},
                     problem.flops() / (us * 1e-6) / 1e12, us / 1e3, 1)


def test_a_bucket_answers_with_the_problem_tuned_at_its_shape() -> None:
    assert DEC16.bucket() == DEC32.bucket()
    measured = [timed(DEC16, "flash_decode", 76.8), timed(DEC16, "sdpa_cudnn", 83.8), timed(DEC16, "sdpa_flash", 85.7),
                timed(DEC32, "flash_decode", 139.3), timed(DEC32, "sdpa_cudnn", 134.6)]
    for order in (measured, measured[::-1]):
        doc = build_lookup(order)
        # both families from B16's search, the kernel first, as measured there (by speed alone cuDNN's
        # B32 figure came first and B16 served cuDNN)
        assert [(e["family"], e["problem"]["batch"]) for e in doc["entries"]] == [
            ("flash_decode", 16), ("sdpa_cudnn", 16), ("sdpa_flash", 16)]


def test_a_merge_keeps_the_entry_tuned_nearer_the_buckets_shape() -> None:
    centre = build_lookup([timed(DEC16, "flash_decode", 76.8), timed(DEC16, "sdpa_cudnn", 83.8)])
    off = build_lookup([timed(DEC32, "flash_decode", 139.3), timed(DEC32, "sdpa_cudnn", 134.6)])
    assert [e["problem"]["batch"] for e in export.merge_lookups(centre, off)["entries"]] == [16, 16]
    # from farther to nearer, and the same problem measured again, the new entry replaces the old
    assert [e["problem"]["batch"] for e in export.merge_lookups(off, centre)["entries"]] == [16, 16]
    again = build_lookup([timed(DEC16, "flash_decode", 70.0), timed(DEC16, "sdpa_cudnn", 90.0)])
    assert [round(e["median_ms"] * 1e3, 1) for e in export.merge_lookups(centre, again)["entries"]] == [70.0, 90.0]


def test_an_empty_file_or_none_is_nothing_to_keep(tmp_path: Path) -> None:
    (tmp_path / "empty.json").write_bytes(b"")
    assert export.existing_lookup(tmp_path / "empty.json") is None
    assert export.existing_lookup(tmp_path / "absent.json") is None
    export.publish_lookup(build_lookup([]), tmp_path / "empty.json", "complete")
    assert read_lookup(tmp_path / "empty.json")["entries"] == []
    with pytest.raises(export.LookupRefused, match="is a directory"):
        export.existing_lookup(tmp_path)


def _as_version_1(doc: dict) -> dict:
    """`doc` as flashtune wrote lookups before masks: `causal` bools, buckets by the longer length."""
    old = json.loads(json.dumps(doc))
    old["version"] = 1
    for e in old["entries"]:
        e["causal"] = e.pop("mask") == "causal"
        e["problem"]["causal"] = e["problem"].pop("mask") == "causal"
        p = e["problem"]
        if p["seqlen_q"] != p["seqlen_k"]:
            e["bucket"] = e["bucket"].split("/n")[0] + "/n" + e["bucket"].split("/n")[1].split("x")[1]
    return old


def test_a_version_1_lookup_is_read_as_version_2(tmp_path: Path) -> None:
    """Lookups written before masks stay usable: causal means top-left, the buckets of Nq != Nk
    problems are recomputed (Nq and Nk rounded apart), and writing over them writes version 2."""
    cache = Problem(1, 8, 100, 3000, 64, "fp16", False, 2)
    new = build_lookup([entry(P1, "simt", 50.0), entry(P2, "wgmma", 90.0), entry(cache, "simt", 20.0)])
    old = _as_version_1(new)
    assert {e["bucket"] for e in old["entries"]} >= {"fp16/d64/full/n4096/small"}   # the old rule
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(old))
    got = read_lookup(path)
    assert got["version"] == SCHEMA_VERSION == 2
    assert sorted(got["entries"], key=lambda e: e["bucket"]) == sorted(new["entries"], key=lambda e: e["bucket"])
    assert {e["mask"] for e in got["entries"]} == {"causal", "none"}
    export.publish_lookup(build_lookup([entry(P1, "wgmma", 300.0)]), path, "merge")
    merged = json.loads(path.read_text())
    assert merged["version"] == 2 and len(merged["entries"]) == 4 and all("causal" not in e for e in merged["entries"])
    write_lookup(old, tmp_path / "again.json")   # a version-1 document given to write_lookup is written as 2
    assert json.loads((tmp_path / "again.json").read_text())["version"] == 2


def test_a_decode_entry_filed_under_the_bottom_right_bucket_is_read_in_its_bucket_of_today(tmp_path: Path) -> None:
    """Lookups written before a one-query bottom-right step was bucketed as no mask
    (problem.seen_mask) are read, not refused (a refused lookup is ignored whole): such an entry
    moves to the unmasked bucket and serves a decode step posed either way; a speculative step of 4
    queries keeps its bottom-right bucket."""
    from tuner.dispatch import Dispatcher
    from tuner.kernel_templates import get_family

    fam = get_family("flash_decode")
    step = Problem(8, 32, 1, 8192, 128, "bf16", "causal_br", 8)
    spec = Problem(8, 32, 4, 8192, 128, "bf16", "causal_br", 8)
    doc = build_lookup([BestEntry(H100_SXM.key, fam.name, p, p.bucket().key, fam.default(H100_SXM, p), 1.0, 0.1, i)
                        for i, p in enumerate((step, spec))])
    for e in doc["entries"]:   # as the last version wrote them
        if e["problem"]["seqlen_q"] == 1:
            e["bucket"], e["mask"] = e["bucket"].replace("/full/", "/causal_br/"), "causal_br"
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    got = {e["problem"]["seqlen_q"]: e for e in read_lookup(path)["entries"]}
    assert (got[1]["bucket"], got[1]["mask"]) == ("bf16/d128/full/n1x8192/large", "none")
    assert (got[4]["bucket"], got[4]["mask"]) == ("bf16/d128/causal_br/n4x8192/large", "causal_br")
    d = Dispatcher(path)
    for p in (step, Problem(8, 32, 1, 8192, 128, "bf16", "none", 8)):
        assert d.select(p, H100_SXM)["problem"]["seqlen_q"] == 1


def test_a_decode_step_recorded_under_the_bottom_right_bucket_exports_to_its_bucket_of_today(tmp_path: Path) -> None:
    """A database whose rows predate problem.seen_mask stores a one-query bottom-right problem's
    bucket as causal_br; its export files it where the dispatcher looks for it today, and the lookup
    written from it reads back (a stale key would have made the whole lookup unreadable)."""
    import sqlite3

    from tuner.kernel_templates import get_family

    fam = get_family("flash_decode")
    step = Problem(8, 32, 1, 8192, 128, "bf16", "causal_br", 8)
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with session_factory(make_engine(url)).begin() as s:
        record_measurement(s, H100_SXM, step, fam.name, fam.default(H100_SXM, step),
                           Measurement("ok", median_ms=0.1, tflops=1.0, versions={"x": "1"}))
        update_best(s, H100_SXM.key, step.key, fam.name)
    with sqlite3.connect(tmp_path / "r.db") as c:   # as the last version stored it
        c.execute("UPDATE ft_problems SET bucket_key = 'bf16/d128/causal_br/n1x8192/large'")
        c.execute("UPDATE ft_best SET bucket_key = 'bf16/d128/causal_br/n1x8192/large'")
    with session_factory(make_engine(url))() as s:
        doc = export.lookup_from_db(s, H100_SXM.key)
    assert {e["bucket"] for e in doc["entries"] if e["family"] == fam.name} == {"bf16/d128/full/n1x8192/large"}
    write_lookup(doc, tmp_path / "best.json")
    assert read_lookup(tmp_path / "best.json")["entries"]

