"""benchmarks/served_alternatives.py's offline part: the kernels it would time for a shape, from the
shipped H200 lookup, each in the form a call runs it and each once."""

from __future__ import annotations

import json

import pytest
from benchmark_scripts import script
from dashboard_dbs import H200

from tuner.dispatch import Dispatcher
from tuner.export import SHIPPED_DIR
from tuner.kernel_templates import FAMILIES
from tuner.problem import Problem

alt = script("served_alternatives")


@pytest.fixture(scope="module")
def shipped():
    return Dispatcher(SHIPPED_DIR / "NVIDIA-H200_sm_90.json")


def test_a_borrowed_call_lists_what_is_served_the_defaults_and_the_nearer_candidates(shipped):
    p = Problem.parse("8,6:6,1415:1415,64,none", "bf16")   # a medium call, its nearest bucket B1's
    alts = alt.alternatives(shipped, p, H200, near=3, octaves=3.0)
    assert list(alts)[:2] == ["served", "default"]   # a medium bucket's entry serves it, the default beside
    nears = [k.split("@")[0] for k in alts if k.startswith("near")]
    assert nears == [f"near{i + 1}" for i in range(len(nears))] and 1 <= len(nears) <= 3
    assert len({json.dumps(v, sort_keys=True) for v in alts.values()}) == len(alts)
    for fam, params in alts.values():
        assert FAMILIES[fam].check(params, H200, p) is None, (fam, params)


def test_a_call_sdpa_serves_still_lists_the_kernels_it_could_run(shipped):
    # its own bucket's cuDNN entry measured fastest (a decode step: since x3 no prefill bucket of the
    # H200's lookup is SDPA's)
    p = Problem.parse("128,32:8,1:1024,128", "bf16")
    assert shipped.serving_entry(p, H200)["family"] == "sdpa_cudnn"
    alts = alt.alternatives(shipped, p, H200)
    assert "served" not in alts and alts["default"][0] == "flash_fwd_sm90"


def test_a_call_of_fewer_blocks_than_sms_nothing_near_serves_runs_the_default(shipped):
    p = Problem.parse("2,8:2,743:8133,128,none", "fp16")   # 96 query blocks, keys too few to split
    served = shipped.serving_entry(p, H200)
    assert served["family"] == "flash_fwd_sm90" and "bucket" not in served
    alts = alt.alternatives(shipped, p, H200)
    assert alts["served"] == ("flash_fwd_sm90", served["params"]) and "default" not in alts   # the same config, once


def test_random_shapes_are_drawn_as_random_shapes_py_draws_them():
    class Args:
        random, kind, shapes = "4:6", "prompt,chunk", []

    shapes = alt.shapes_of(Args)
    assert 1 <= len(shapes) <= 6
    assert all(p.seqlen_q > 16 or p.seqlen_q == p.seqlen_k for p in (Problem.parse(s, "bf16") for s in shapes))
    assert alt.shapes_of(Args) == shapes


def test_a_speculative_gqa_step_lists_the_packed_kernel_and_what_served_before_it(shipped):
    p = Problem.parse("32,64:8,16:8192,128,causal_br", "bf16")   # 128 packed rows a K/V head
    alts = alt.alternatives(shipped, p, H200)
    assert alts["served"][0] == "flash_fwd_sm90_gqa" and "packed" not in alts   # the same config, listed once
    assert alts["unpacked"][0].startswith("flash_decode")
    small = Problem.parse("32,32:8,2:8192,128,causal_br", "bf16")   # 8 rows: flash_decode serves, packed beside
    alts = alt.alternatives(shipped, small, H200)
    assert alts["served"][0].startswith("flash_decode") and alts["packed"][0] == "flash_fwd_sm90_gqa"
    assert "unpacked" not in alts   # the served entry itself
    chunk = Problem.parse("8,32:8,64:8192,128,causal_br", "bf16")   # a prefill bucket's config, 256 packed rows
    alts = alt.alternatives(shipped, chunk, H200)
    assert alts["served"][0] == "flash_fwd_sm90_gqa"   # what served before (the default's config here) beside it
    assert select_form(shipped, chunk) in alts.values() and select_form(shipped, chunk)[0] == "flash_fwd_sm90"


def select_form(dispatcher, p):
    from tuner.dispatch import _served_form

    entry = _served_form(dispatcher.select(p, H200), p, H200)
    return entry["family"], entry["params"]


def test_measured_lists_a_databases_fastest_distinct_kernel_configs_of_the_shape(tmp_path, monkeypatch):
    from tuner.db import make_engine, queries, session_factory
    from tuner.records import Measurement

    p = Problem.parse("32,64:8,16:8192,128,causal_br", "bf16")
    other = Problem.parse("16,32:8,16:16384,128,causal_br", "bf16")
    fam = FAMILIES["flash_fwd_sm90_gqa"]
    a, b, c = ({**fam.default(H200, p), "Bc": bc} for bc in (64, 80, 128))
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with session_factory(make_engine(url))() as s, s.begin():
        for prob, family, params, status, tf in [
            (p, fam.name, a, "ok", 400.0), (p, fam.name, a, "ok", 420.0),   # one config twice: listed once
            (p, fam.name, b, "ok", 480.0), (p, fam.name, c, "wrong_result", 900.0),   # a failure: never
            (p, "sdpa_cudnn", {}, "ok", 500.0),                                      # a peer: timed anyway
            (other, fam.name, c, "ok", 700.0),                                        # another shape
        ]:
            queries.record_measurement(s, H200, prob, family, params, Measurement(status, 1.0, 1.0, 1.0, tf))
    monkeypatch.setenv("TUNER_DB", url)
    assert alt.measured(p, H200, 5) == {"db1": (fam.name, b), "db2": (fam.name, a)}
    assert alt.measured(p, H200, 1) == {"db1": (fam.name, b)}
    monkeypatch.setenv("TUNER_DB", f"sqlite:///{tmp_path / 'absent.db'}")
    assert alt.measured(p, H200, 3) == {}   # no database: nothing added, one line said


def test_a_configured_candidate_is_the_familys_default_with_the_given_params_over_it(capsys):
    p = Problem.parse("16,40:8,16:8192,128,causal_br", "bf16")
    fam = FAMILIES["flash_fwd_sm90_gqa"]
    got = alt.configured(p, H200, ['bc80=flash_fwd_sm90_gqa:{"Bc": 80, "split": 24}',
                                   'wide=flash_fwd_sm90_gqa:{"Bc": 176, "cwg": 3}',   # refused: printed, left out
                                   'plain=flash_decode:'])
    assert got["bc80"] == (fam.name, {**fam.default(H200, p), "Bc": 80, "split": 24})
    assert "wide" not in got and "wide: left out" in capsys.readouterr().out
    assert got["plain"] == ("flash_decode", FAMILIES["flash_decode"].default(H200, p))
    with pytest.raises(SystemExit):
        alt.configured(p, H200, ["nofamily"])


def test_served_as_times_the_served_params_in_another_familys_form(shipped, capsys):
    """A d=80 call of one query block a head runs the persistent default plain (pairs_form: a lone
    block would idle its pair's second CTA); --served-as times that config in pairs beside it, and
    leaves out a family that refuses it (pairs run unmasked calls only) or a call nothing of ours serves."""
    p = Problem.parse("16,32,68:6188,80,none", "bf16")
    served = alt.alternatives(shipped, p, H200)["served"]
    got = alt.served_as(served, p, H200, ["pairs=flash_fwd_sm90_pairs", "tail=flash_fwd_sm90_tail"])
    assert got["pairs"] == ("flash_fwd_sm90_pairs", served[1]) and got["tail"][0] == "flash_fwd_sm90_tail"
    causal = Problem.parse("16,32,68:6188,80,causal_br", "bf16")
    assert alt.served_as(served, causal, H200, ["pairs=flash_fwd_sm90_pairs"]) == {}
    assert alt.served_as(None, p, H200, ["pairs=flash_fwd_sm90_pairs"]) == {}
    out = capsys.readouterr().out
    assert "runs the masks none" in out and "no kernel of ours serves" in out
    with pytest.raises(SystemExit):
        alt.served_as(served, p, H200, ["pairs=nofamily"])


def test_a_tuned_split_count_is_listed_as_the_call_runs_it(shipped):
    """The shipped entry tuned on an 8-head shard (32 blocks) splits 4 ways; served to 12 heads of a
    chunk (36 blocks) it splits from the occupancy (KernelFamily.adapt), and "served" is that form,
    the one a plan runs, not the stored count."""
    from tuner.dispatch import served_params

    p = Problem.parse("1,12:2,350:6000,128,causal_br", "bf16")
    entry = shipped.serving_entry(p, H200)
    assert entry["family"] == "flash_fwd_sm90_split" and entry["params"]["splits"] == 4
    alts = alt.alternatives(shipped, p, H200)
    assert alts["served"] == (entry["family"], served_params(entry, p)) and alts["served"][1]["splits"] == 0


def test_a_saved_entry_fixes_its_split_count_and_compiles_as_its_occupancy(shipped, tmp_path):
    """--save-served fixes a split count left to the occupancy (another checkout's estimate would
    re-derive it), --entries reads it back by problem key; a count outside the space (3) compiles
    as the occupancy's cubin, which launches any count."""
    p = Problem.parse("1,3,131:6689,64,causal_br", "bf16")   # a few blocks' keys split
    fam, params = alt.alternatives(shipped, p, H200, near=0)["served"]
    assert fam == "flash_fwd_sm90_split" and params["splits"] == 0
    fixed = alt.fixed_counts(fam, params, p, H200)
    split = FAMILIES[fam]
    assert fixed["splits"] == split.splits(params, p, H200) > 1
    assert fixed == alt.fixed_counts(fam, fixed, p, H200)   # a fixed count stays
    saved = tmp_path / "before.json"
    saved.write_text(json.dumps({p.key: [fam, dict(fixed, splits=3)]}))
    entries = alt.from_files(p, [f"before={saved}"])
    assert entries == {"before": (fam, dict(fixed, splits=3))}
    assert alt.from_files(Problem.parse("1,3,131:6000,64,causal_br", "bf16"), [f"before={saved}"]) == {}
    assert split.check(entries["before"][1], H200, p) is not None   # 3 is not a point of the space
    compiled = split.compiled(entries["before"][1])
    assert compiled["splits"] == 0 and split.check(compiled, H200, p) is None
    assert split.launch(entries["before"][1], p, H200).grid[2] == 3
    with pytest.raises(SystemExit, match="NAME=FILE"):
        alt.from_files(p, ["before"])


def test_a_candidate_that_repeats_an_alternative_is_timed_once_and_named_for_both():
    """--entries old=FILE whose config is what the default already is: one compile and timing,
    and the row says old is the default's, so an A/B reads both names."""
    default = ("flash_fwd_sm90", {"Bc": 128, "cwg": 2})
    alts = {"served": ("flash_fwd_sm90", {"Bc": 176, "cwg": 2}), "default": default}
    more = {"old": ("flash_fwd_sm90", {"Bc": 128, "cwg": 2}), "c3": ("flash_fwd_sm90", {"Bc": 128, "cwg": 3})}
    assert alt.add_more(alts, more) == {"old": "default"}
    assert list(alts) == ["served", "default", "c3"] and alts["c3"] == more["c3"]


def test_an_ab_reads_served_over_the_other_checkouts_choice_by_its_name_or_its_twin():
    """served_over: what served over --entries old's figure, that of the alternative old repeats
    where it repeats one, and no ratio where either was not timed (a failed check)."""
    rows = [{"shape": "a", "tflops": {"served": 120.0, "old": 100.0}, "same": {}},
            {"shape": "b", "tflops": {"served": 90.0, "default": 100.0}, "same": {"old": "default"}},
            {"shape": "c", "tflops": {"served": 90.0, "old": None}, "same": {}},
            {"shape": "d", "tflops": {"served": 50.0}}]
    assert alt.served_over(rows, "old") == {"a": 1.2, "b": 0.9}
