"""benchmarks/ab_kernel.py's choice of points to time (offline: no GPU)."""

from __future__ import annotations

from benchmark_scripts import script

from tuner.gpu import H100_SXM
from tuner.kernel_templates import get_family
from tuner.problem import Problem


def test_values_of_a_set_make_a_point_each_and_a_refused_one_is_left_out_with_its_reason(capsys):
    ab = script("ab_kernel")
    fam = get_family("flash_fwd_sm90_split")
    points = ab.timed_points(fam, H100_SXM, ["1,4,129:1683,96", "2,8,256:4000,64"], ["splits=2,8,16"], [], None, False)
    got = [(p.key, c["splits"]) for p, c in points]
    # 1683 keys are 10 K/V tiles of the d=96 default's Bc 176: 16 splits exceed them; 4000 keys take 16
    assert got == [("B1-H4-N129x1683-D96-bf16-full", 2), ("B1-H4-N129x1683-D96-bf16-full", 8),
                   ("B2-H8-N256x4000-D64-bf16-full", 2), ("B2-H8-N256x4000-D64-bf16-full", 8),
                   ("B2-H8-N256x4000-D64-bf16-full", 16)]
    assert all(c == dict(fam.default(H100_SXM, p), splits=c["splits"]) for p, c in points)
    assert "splits=16 exceeds the 10 K/V tiles" in capsys.readouterr().out


def test_shape_filter_narrows_the_points():
    ab = script("ab_kernel")
    fam = get_family("flash_fwd_sm90_split")
    points = ab.timed_points(fam, H100_SXM, ["1,4,129:1683,96", "2,8,256:4000,64"], [], ["D64"], None, False)
    assert [p.key for p, _ in points] == ["B2-H8-N256x4000-D64-bf16-full"]


def test_a_shape_the_family_does_not_take_is_left_out_with_its_reason(capsys):
    ab = script("ab_kernel")
    fam = get_family("flash_fwd_sm90_gqa")   # packs query heads: none to pack at 8 heads on 8
    step = Problem.parse("1,8:2,16:4096,128", "bf16")
    points = ab.timed_points(fam, H100_SXM, ["1,8,256:6113,96", "1,8:2,16:4096,128"], [], [], None, False)
    assert points == [(step, fam.default(H100_SXM, step))]
    assert "one query head per K/V head" in capsys.readouterr().out


def test_a_split_point_unsplit_is_its_config_in_flash_fwd_sm90_and_other_families_have_none():
    ab = script("ab_kernel")
    split, gqa = get_family("flash_fwd_sm90_split"), get_family("flash_fwd_sm90_gqa")
    p = Problem.parse("1,8,256:6113,96", "bf16")
    (_, params), = ab.timed_points(split, H100_SXM, ["1,8,256:6113,96"], ["splits=4"], [], None, False)
    fam, plain = ab.unsplit_form(split, H100_SXM, p, params)
    assert fam.name == "flash_fwd_sm90" and plain == {k: v for k, v in params.items() if k != "splits"}
    assert fam.check(plain, H100_SXM, p) is None
    step = Problem.parse("1,8:2,16:4096,128", "bf16")
    assert ab.unsplit_form(gqa, H100_SXM, step, gqa.default(H100_SXM, step)) is None
