"""The CLI without a GPU: every user mistake is one line on stderr and a non-zero exit, no traceback.

Run as `python -m tuner.cli` in a subprocess, with CUDA_VISIBLE_DEVICES="" so no GPU is seen on
any machine, and TUNER_DB / TUNER_LOOKUP pointing into tmp_path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from tuner.db import queries
from tuner.db.engine import make_engine, session_factory
from tuner.gpu import H100_SXM
from tuner.problem import Problem
from tuner.records import Measurement


@dataclass
class Out:
    code: int
    stdout: str
    stderr: str

    @property
    def text(self) -> str:
        return self.stdout + self.stderr


@pytest.fixture
def cli(tmp_path):
    env = dict(os.environ, TUNER_DB=f"sqlite:///{tmp_path / 'env.db'}", TUNER_LOOKUP=str(tmp_path / "best.json"),
               CUDA_VISIBLE_DEVICES="", NO_COLOR="1", COLUMNS="200")

    def run(*args: str, block: tuple[str, ...] = (), extra_env: dict[str, str] | None = None) -> Out:
        """`block`: driver packages the run must find missing, however installed (psycopg is, for
        the fleet tests): a package of that name that fails to import, first on its path."""
        extra = dict(extra_env or {})
        if block:
            shadow = tmp_path / "blocked"
            for name in block:
                (shadow / name).mkdir(parents=True, exist_ok=True)
                (shadow / name / "__init__.py").write_text(f"raise ImportError({f'No module named {name}'!r})\n")
            extra["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shadow), env.get("PYTHONPATH")]))
        p = subprocess.run([sys.executable, "-m", "tuner.cli", *args], env={**env, **extra}, capture_output=True,
                           text=True, timeout=120, cwd=tmp_path)
        return Out(p.returncode, p.stdout, p.stderr)

    return run


@pytest.fixture(scope="module")
def replay_url(tmp_path_factory) -> str:
    """A tiny recorded DB so `search --replay` gets past the GPU step."""
    url = f"sqlite:///{tmp_path_factory.mktemp('cli') / 'replay.db'}"
    p = Problem(2, 4, 512, 512, 64, "fp32", True)
    with session_factory(make_engine(url)).begin() as s:
        queries.record_measurement(s, H100_SXM, p, "flash_fwd_simt",
                                   dict(Br=64, Bc=64, TM=4, TN=4, stages=1, min_blocks=1),
                                   Measurement("ok", median_ms=1.0, tflops=p.tflops(1.0), versions={"x": "1"}))
    return url


def one_line_error(out: Out, *words: str) -> str:
    assert out.code != 0, out
    assert "Traceback" not in out.text, out.text
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_main_guard_and_help(cli):
    out = cli("--help")
    assert out.code == 0 and "search" in out.stdout and "gpus" in out.stdout and "export" in out.stdout


def test_search_without_gpu(cli, tmp_path):
    out = cli("search", "--gpu", "auto", "--trials", "2")
    line = one_line_error(out, "no CUDA GPU")
    assert out.code == 1 and line.startswith("error:")
    assert not (tmp_path / "best.json").exists()


def test_search_default_gpu_without_gpu(cli):
    out = cli("search", "--shape", "1,2,128,64")
    one_line_error(out, "no CUDA GPU")
    assert out.code == 1


def test_gpus_without_gpu(cli):
    out = cli("gpus")
    assert out.code == 1 and "Traceback" not in out.text
    assert "no CUDA GPU is visible" in out.stdout


def test_bench_without_gpu(cli):
    out = cli("bench", "--shape", "1,2,128,64")
    one_line_error(out, "no CUDA GPU")
    assert out.code == 1


def test_max_error_out_of_range_is_one_line(cli):
    out = cli("search", "--shape", "1,2,128,64", "--max-error", "2")
    one_line_error(out, "--max-error must be in (0, 1)")
    assert out.code != 0


def test_bench_unknown_peer_is_refused_before_anything_runs(cli):
    out = cli("bench", "--shape", "1,2,128,64", "--peer", "sdpa_flash", "--peer", "flash3")
    assert out.code != 0
    assert "unknown peer 'flash3'" in out.text and "sdpa_cudnn" in out.text
    assert "Traceback" not in out.text


@pytest.mark.parametrize(
    "shape,words",
    [("2,4,512", ["'2,4,512'", "must be B,H[:KVH],NQ[:NK],D[,MASK]"]), ("2,4,x,64", ["'2,4,x,64'", "must be integers"]),
     ("2,4,512,64,sideways", ["the mask field must be one of"]), ("2,4:3,512,64", ["kv_heads (3) must divide heads (4)"]), ("0,4,512,64", ["batch must be a positive integer"])],
    ids=["three-fields", "not-int", "bad-flag", "gqa-not-dividing", "zero-batch"],
)
def test_malformed_shape(cli, shape, words):
    out = cli("search", "--shape", shape, "--trials", "2")
    one_line_error(out, "error:", *words)
    assert out.code == 2


def test_shape_format_is_documented_and_new_fields_reach_the_problem(cli, replay_url):
    """GQA, Nq != Nk and the bottom-right mask parse into the problem the search asks for."""
    out = cli("search", "--help")
    assert out.code == 0 and "B,H[:KVH],NQ[:NK],D[,MASK]" in out.stdout and "causal_br" in out.stdout
    out = cli("search", "--replay", replay_url, "--shape", "2,4:2,512:1024,64,bottom_right", "--trials", "2")
    one_line_error(out, "error:", "no measurements of B2-H4/kv2-N512x1024-D64-fp32-causal_br")


def test_model_problems_reach_the_search(cli, replay_url):
    """--model with --seqlen NQ:NK and --batch: the model's problems, a cached chunk bottom-right."""
    out = cli("search", "--replay", replay_url, "--model", "llama3-8b", "--seqlen", "512:8192", "--batch", "2",
              "--trials", "2")
    one_line_error(out, "error:", "no measurements of B2-H32/kv8-N512x8192-D128-bf16-causal_br")
    one_line_error(cli("search", "--model", "vit-l16", "--seqlen", "1024"), "has its own sequence lengths (197)")
    one_line_error(cli("search", "--batch", "2"), "--seqlen and --batch go with --model")
    out = cli("search", "--help")
    assert "llama3-8b" in out.stdout and "standard grid" in out.stdout


def test_bad_dtype(cli):
    out = cli("search", "--dtype", "int8", "--shape", "1,2,128,64")
    one_line_error(out, "--dtype", "'int8' is not one of 'fp32', 'fp16', 'bf16', 'fp8'")
    assert out.code == 2 and out.stdout == ""  # refused before the header or a progress bar


def test_fp8_search_without_gpu(cli, tmp_path):
    out = cli("search", "--gpu", "auto", "--dtype", "fp8", "--trials", "2")
    line = one_line_error(out, "no CUDA GPU")
    assert out.code == 1 and line.startswith("error:")
    assert not (tmp_path / "best.json").exists()


def test_fp8_help_and_a_family_that_takes_no_fp8(cli, replay_url):
    assert "fp8 = e4m3 inputs, bf16 output" in cli("search", "--help").stdout
    out = cli("search", "--replay", replay_url, "--shape", "1,2,128,64", "--dtype", "fp8", "--family", "flash_fwd_mma",
              "--no-peers")
    one_line_error(out, "B1-H2-N128-D64-fp8-full", "flash_fwd_mma takes fp32/fp16/bf16 inputs, not fp8")
    assert out.code == 2


def test_unknown_family(cli):
    out = cli("search", "--family", "flash_fwd_tma", "--shape", "1,2,128,64")
    one_line_error(out, "--family", "'flash_fwd_tma' is not one of", "flash_fwd_simt")
    assert out.code == 2 and out.stdout == ""


def test_unsupported_head_dim_with_replay(cli, replay_url):
    out = cli("search", "--replay", replay_url, "--shape", "1,2,128,80", "--no-peers")
    one_line_error(out, "head dim", "80")
    assert out.code == 2


def test_unwritable_db_search(cli, replay_url, tmp_path):
    out = cli("search", "--replay", replay_url, "--db", "sqlite:////proc/nope/x.db", "--shape", "2,4,512,64,causal",
              "--trials", "1", "--no-peers", "--lookup", str(tmp_path / "l.json"))
    one_line_error(out, "/proc/nope")
    assert out.code == 2


def test_unwritable_db_export(cli, tmp_path):
    out = cli("export", "-o", str(tmp_path / "x.json"), "--db", "sqlite:////proc/nope/x.db")
    one_line_error(out, "no database at /proc/nope/x.db", "never create")
    assert out.code == 2


def test_unwritable_db_from_env(cli, tmp_path, monkeypatch):
    env = dict(os.environ, TUNER_DB="sqlite:////proc/nope/y.db", CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "-m", "tuner.cli", "export", "-o", str(tmp_path / "x.json")], env=env,
                       capture_output=True, text=True, timeout=120)
    one_line_error(Out(p.returncode, p.stdout, p.stderr), "/proc/nope")


def test_malformed_db_url(cli, tmp_path):
    out = cli("export", "-o", str(tmp_path / "x.json"), "--db", "not a url")
    one_line_error(out, "malformed database URL")
    assert out.code == 2


def test_replay_db_missing_or_without_measurements(cli, tmp_path):
    out = cli("search", "--replay", f"sqlite:///{tmp_path / 'missing.db'}", "--shape", "1,2,128,64", "--no-peers")
    one_line_error(out, "no database at")
    assert out.code == 2
    from tuner.db.engine import make_engine

    make_engine(f"sqlite:///{tmp_path / 'empty.db'}").dispose()
    out = cli("search", "--replay", f"sqlite:///{tmp_path / 'empty.db'}", "--shape", "1,2,128,64", "--no-peers")
    one_line_error(out, "holds no measurements")
    assert out.code == 2


def test_export_empty_db_warns(cli, tmp_path):
    make_engine(f"sqlite:///{tmp_path / 'fresh.db'}").dispose()
    out = cli("export", "-o", str(tmp_path / "x.json"), "--db", f"sqlite:///{tmp_path / 'fresh.db'}")
    assert out.code == 0 and "no tuned configs yet" in out.stderr and "0 entries" in out.stdout


def test_usage_error_is_not_a_traceback(cli):
    out = cli("search", "--trials", "0")
    assert out.code == 2 and "Traceback" not in out.text and "--trials" in out.stderr


def test_version(cli):
    from importlib.metadata import version

    out = cli("--version")
    assert out.code == 0 and out.stdout.strip() == f"flashtune {version('flashtune')}"


@pytest.mark.parametrize("args,words", [
    (("--sampler", "annealing"), ("--sampler", "'annealing' is not one of 'tpe', 'random', 'grid'")),
    (("--dtype", "fp64"), ("--dtype", "'fp64'")),
    (("--family", "flash_fwd_tma"), ("--family", "'flash_fwd_tma'")),
], ids=["sampler", "dtype", "family"])
def test_choices_are_refused_before_any_output(cli, replay_url, tmp_path, args, words):
    out = cli("search", "--replay", replay_url, "--shape", "2,4,512,64,causal", "--no-peers", *args,
              "--db", f"sqlite:///{tmp_path / 'r.db'}")
    one_line_error(out, *words)
    assert out.code == 2 and out.stdout == "" and not (tmp_path / "r.db").exists()
    assert "tpe" in cli("search", "--help").stdout  # the choices are listed in --help


def test_replay_of_a_problem_the_recording_lacks(cli, replay_url, tmp_path):
    out = cli("search", "--replay", replay_url, "--shape", "2,4,512,64", "--no-peers", "--trials", "50",
              "--db", f"sqlite:///{tmp_path / 'r.db'}")
    one_line_error(out, "has no measurements of B2-H4-N512-D64-fp32-full", "it has B2-H4-N512-D64-fp32-causal")
    assert out.code == 2 and out.stdout == ""
    assert not (tmp_path / "r.db").exists()  # no study, no FAIL trials, no empty table


@pytest.mark.parametrize("url,words", [
    ("postgresql://bob:hunter2@localhost/ft", ("bob:***@localhost", "pip install")),
    ("mysql://bob:hunter2@localhost/ft", ("bob:***@localhost", "pip install")),
    ("sqlite://", ("in-memory database",)),
    ("sqlite:///:memory:", ("in-memory database",)),
], ids=["postgresql", "mysql", "memory", "memory-named"])
@pytest.mark.parametrize("command", ["search", "export", "migrate", "status", "submit", "worker"])
def test_unusable_database_url_is_one_line_without_the_password(cli, replay_url, tmp_path, url, words, command):
    block: tuple[str, ...] = ()
    if url.startswith(("postgresql", "mysql")):
        from sqlalchemy.engine import make_url

        driver = make_url(url).get_dialect().driver
        block = ({"mysqldb": "MySQLdb"}.get(driver, driver),)
    args = {"search": ("search", "--replay", replay_url, "--shape", "2,4,512,64,causal", "--no-peers", "--db", url),
            "export": ("export", "-o", str(tmp_path / "x.json"), "--db", url),
            "migrate": ("migrate", "--db", url), "status": ("status", "--db", url),
            "submit": ("submit", "--shape", "2,4,512,64", "--gpu-key", "k/sm_90", "--db", url),
            "worker": ("worker", "--replay", replay_url, "--db", url)}[command]
    out = cli(*args, block=block)
    one_line_error(out, *words)
    assert out.code == 2 and "hunter2" not in out.text and not (tmp_path / "x.json").exists()


def test_a_read_only_database_is_one_line_for_search(cli, replay_url, tmp_path):
    import shutil

    db = tmp_path / "ro.db"
    shutil.copy(replay_url.removeprefix("sqlite:///"), db)
    before = db.read_bytes()
    out = cli("search", "--replay", replay_url, "--shape", "2,4,512,64,causal", "--no-peers",
              "--db", f"sqlite:///file:{db}?mode=ro&uri=true")
    one_line_error(out, "cannot open the database", "readonly")
    assert db.read_bytes() == before


def test_usage_errors_are_one_line_without_click_installed(tmp_path):
    """typer >= 0.20 vendors click; the error handler must not need the real one."""
    code = ("import sys; sys.modules['click'] = None\n"
            "from tuner.cli import main; sys.argv = ['tuner', 'search', '--trials', '0']; main()")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES="", NO_COLOR="1"))
    out = Out(p.returncode, p.stdout, p.stderr)
    one_line_error(out, "--trials")
    assert out.code == 2


def test_migrate_upgrades_an_existing_database_and_creates_none(cli, tmp_path):
    out = cli("migrate", "--db", f"sqlite:///{tmp_path / 'none.db'}")
    one_line_error(out, "no database at")
    assert not (tmp_path / "none.db").exists()
    from alembic import command
    from sqlalchemy import create_engine

    from tuner.db.engine import _alembic_config

    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = create_engine(url)
    with engine.begin() as conn:  # the schema an older flashtune left
        command.upgrade(_alembic_config(conn), "0002")
    engine.dispose()
    before = (tmp_path / "old.db").read_bytes()
    out = cli("export", "-o", str(tmp_path / "x.json"), "--db", url)
    assert (tmp_path / "old.db").read_bytes() == before
    one_line_error(out, "schema version 2", "tuner migrate --db")
    out = cli("migrate", "--db", url)
    assert out.code == 0, out.stderr
    assert cli("export", "-o", str(tmp_path / "x.json"), "--db", url).code == 0


def test_bench_replays_a_recording(cli, tmp_path):
    """`tuner bench --replay`: the recording's stored best and peers, through the same runner
    interface as the GPU's, every row stored under one run in --db, the JSON rows as on a GPU."""
    import json
    from pathlib import Path

    fixture = Path(__file__).parent / "fixtures" / "h100_simt.db"
    before = fixture.read_bytes()
    db = f"sqlite:///{tmp_path / 'bench.db'}"
    out = cli("bench", "--replay", str(fixture), "--shape", "2,4,512,64,causal", "--db", db, "--json",
              str(tmp_path / "bench.json"))
    assert out.code == 0, out.text
    assert "B2-H4-N512-D64-fp32-causal" in out.stdout and "efficient" in out.stdout
    assert fixture.read_bytes() == before   # the recording is only read
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["family"] == "flash_fwd_simt" and rows[0]["tuned_tflops"] > 0
    assert rows[0]["sdpa_efficient_tflops"] > 0 and rows[0]["sdpa_math_tflops"] > 0
    with session_factory(make_engine(db))() as s:
        got = queries.measurements(s)
    assert {r["family"] for r in got} == {"flash_fwd_simt", "sdpa_efficient", "sdpa_math"}
    assert len({r["run_id"] for r in got}) == 1   # one bench, one run


def test_bench_leaves_a_varlen_variants_best_to_varlen_bench(cli, tmp_path):
    """A varlen variant's stored best was timed on a packed length mix: `tuner bench` (dense calls
    beside dense peers) times the dense family's best of that problem without a word about the
    variant's, and --family <variant> is refused in one line that says what times packed calls."""
    import json

    from tuner.kernel_templates import FAMILIES, VARIANTS_BY_NAME

    p, variant = Problem(4, 8, 1024, 1024, 128, "bf16", True, kv_heads=2), VARIANTS_BY_NAME["flash_fwd_sm90_varlen"]
    dense = FAMILIES["flash_fwd_sm90"].seeds(H100_SXM, p)[0]
    replay = f"sqlite:///{tmp_path / 'replay.db'}"
    with session_factory(make_engine(replay)).begin() as s:
        for family, params, tflops in ((variant.name, variant.from_tuned(dense, p), 900.0),
                                       ("flash_fwd_sm90", dense, 300.0)):
            ms = p.flops() / tflops / 1e9
            queries.record_measurement(s, H100_SXM, p, family, params,
                                       Measurement("ok", median_ms=ms, tflops=tflops, versions={"x": "1"}))
            queries.update_best(s, H100_SXM.key, p.key, family)
        queries.record_measurement(s, H100_SXM, p, "sdpa_flash", {}, Measurement("ok", median_ms=1.0, tflops=p.tflops(1.0)))
    args = ("bench", "--replay", replay, "--db", f"sqlite:///{tmp_path / 'b.db'}", "--shape", "4,8:2,1024,128,causal",
            "--dtype", "bf16", "--json", str(tmp_path / "b.json"))
    out = cli(*args)
    assert out.code == 0, out.text
    assert variant.name not in out.text and "warning" not in out.text
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [(r["family"], r["config"]) for r in rows] == [("flash_fwd_sm90", dense)]
    out = cli(*args, "--family", variant.name)
    one_line_error(out, "--family", "packed sequences", "varlen_bench.py")
    assert out.code == 2 and out.stdout == ""


def test_bench_json_keeps_the_rows_measured_before_a_failure(tmp_path, monkeypatch):
    """`tuner bench --json` writes its rows after every problem: a run that dies on its third
    problem (a killed call, a crashed peer) keeps the two it measured, and no temporary file."""
    import json
    from pathlib import Path

    from typer.testing import CliRunner

    from tuner.bench import Bench
    from tuner.cli import app

    fixture = Path(__file__).parent / "fixtures" / "h100_simt.db"
    real, calls = Bench.best, []

    def best(self, problem, *args, **kwargs):
        calls.append(problem.key)
        if len(calls) == 3:
            raise RuntimeError("the GPU went away")
        return real(self, problem, *args, **kwargs)

    monkeypatch.setattr(Bench, "best", best)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(app, ["bench", "--replay", str(fixture), "--db", f"sqlite:///{tmp_path / 'b.db'}",
                                 "--shape", "2,4,512,64,causal", "--shape", "2,4,512,64", "--shape", "3,4,500,64",
                                 "--json", str(out)])
    assert r.exit_code != 0 and len(calls) == 3
    rows = json.loads(out.read_text())["rows"]
    assert [row["seqlen_q"] for row in rows] == [512, 512] and rows[0]["tuned_tflops"] > 0
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".part"] == []


def test_a_search_whose_timeout_ran_out_names_the_problems_left_without_a_trial(tmp_path, monkeypatch):
    """--timeout is one deadline for the whole search: the problems it leaves untouched are not
    measured at all (not even their peers) and one line names them and says how to go on."""
    import time

    from typer.testing import CliRunner

    from tuner.cli import app
    from tuner.search import Search

    replay, point = f"sqlite:///{tmp_path / 'replay.db'}", dict(Br=64, Bc=64, TM=4, TN=4, stages=1, min_blocks=1)
    with session_factory(make_engine(replay)).begin() as s:
        for p in (Problem(2, 4, 512, 512, 64, "fp32", True), Problem(2, 4, 512, 512, 64, "fp32", False)):
            queries.record_measurement(s, H100_SXM, p, "flash_fwd_simt", point,
                                       Measurement("ok", median_ms=1.0, tflops=p.tflops(1.0), versions={"x": "1"}))
    clock, real_tune_all, peers_of = [0.0], Search.tune_all, []

    def tune_all(self, families, problem, *args, **kwargs):
        out = real_tune_all(self, families, problem, *args, **kwargs)
        clock[0] += 10.0   # the first problem took 10 s of a 5 s budget
        return out

    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(Search, "tune_all", tune_all)
    # the study opens on the recorded point: a replay hit that does not wait on the sampler's luck
    monkeypatch.setattr(Search, "starts", lambda self, family, problem: [dict(point)])
    monkeypatch.setattr(Search, "measure_peers", lambda self, p: peers_of.append(p.key) or {})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    r = CliRunner().invoke(app, ["search", "--replay", replay, "--db", f"sqlite:///{tmp_path / 's.db'}",
                                 "--shape", "2,4,512,64,causal", "--shape", "2,4,512,64", "--trials", "2",
                                 "--timeout", "5", "--family", "flash_fwd_simt"])
    assert r.exit_code == 0, r.output
    assert peers_of == ["B2-H4-N512-D64-fp32-causal"]
    text = " ".join(r.output.split())   # the console may wrap the line at any width
    line = text[text.index("--timeout 5 s"):text.index("Run the same command")]
    assert "ran out" in line and "1 problem(s)" in line and "B2-H4-N512-D64-fp32-full" in line
    assert "B2-H4-N512-D64-fp32-causal" not in line


def test_submit_takes_the_problems_search_takes(cli, tmp_path):
    """`tuner submit` queues what `tuner search` would tune: model-table names with --seqlen, a
    recording of `tuner record`, a config.json and shapes, one job per (problem, family)."""
    import json
    import sqlite3

    from tuner.models import model_problems
    from tuner.problem import Problem
    from tuner.recording import Recorder

    rec = tmp_path / "rec.jsonl"
    recorded = Problem(1, 8, 7, 300, 128, "bf16", "causal_br", 2)
    Recorder(rec).note(recorded)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 768}))
    db = tmp_path / "q.db"
    out = cli("submit", "--model", "llama3-8b", "--seqlen", "2048", "--model", str(cfg), "--recorded", str(rec),
              "--shape", "2,4,512,64,causal", "--dtype", "bf16", "--gpu-key", "NVIDIA-H100-80GB-HBM3/sm_90",
              "--family", "flash_fwd_sm90", "--db", f"sqlite:///{db}")
    assert out.code == 0, out.text
    with sqlite3.connect(db) as c:
        keys = {k for (k,) in c.execute("SELECT problem_key FROM ft_jobs WHERE family = 'flash_fwd_sm90'")}
    want = {p.key for p in model_problems(["llama3-8b"], "bf16", ["2048"])} | {recorded.key}
    want |= {Problem(2, 4, 512, 512, 64, "bf16", "causal").key}
    assert want <= keys and "B8-H12/kv4-N2048-D64-bf16-causal" in keys, keys   # the config at --seqlen, 16k tokens


def test_precompile_builds_the_cpp_call_path(cli):
    """`tuner precompile` also builds (or finds in the cache) the C++ call path of `attention`, so a
    deployment need not build it on its first call; FLASHTUNE_NATIVE=0 says it is off, and the
    command still succeeds."""
    from tuner import native

    out = cli("precompile", "--arch", "sm_80", "--family", "flash_fwd_sm90", "--shape", "1,2,64,64")
    assert out.code == 0, out.text
    assert "0 kernels for sm_80" in out.text   # Hopper's family has no point on sm_80: only the C++ path is built
    assert f"the C++ call path: {native.built()}" in out.text, out.text
    off = cli("precompile", "--arch", "sm_80", "--family", "flash_fwd_sm90", "--shape", "1,2,64,64",
              extra_env={native.ENV: "0"})
    assert off.code == 0 and f"not available ({native.ENV}=0)" in off.text, off.text
