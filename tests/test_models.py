"""The model table (tuner/models.py) and the default problem set of `tuner search`."""

from __future__ import annotations

import pytest

from tuner.gpu import A100_SXM, H100_SXM, GpuSpec
from tuner.kernel_templates import FAMILIES
from tuner.models import MODELS, default_dtype, default_problems, get_model, model_problems
from tuner.problem import GPT2_FP32, standard_grid


def test_the_table_has_the_models_the_issue_names():
    assert {"llama3-8b", "llama3-70b", "qwen2.5-7b", "mistral-7b", "gemma2-9b", "gpt2", "gpt2-xl", "vit-l16", "sdxl",
            "whisper", "phi3-mini", "phi-2", "sd15", "dit-xl2"} <= set(MODELS)
    keys = {p.key for p in model_problems(list(MODELS), "bf16")}
    for want in ("B1-H32/kv8-N8192-D128-bf16-causal",    # Llama-3-8B prefill, GQA 4:1
                 "B1-H16/kv8-N8192-D256-bf16-causal",    # Gemma-2, d=256
                 "B32-H16-N197-D64-bf16-full",           # ViT-L/16 at 224 px
                 "B2-H10-N4096-D64-bf16-full", "B2-H10-N4096x77-D64-bf16-full",   # SDXL self and cross
                 "B1-H20-N1500-D64-bf16-full", "B8-H25-N1024-D64-bf16-causal",    # Whisper, GPT-2-XL
                 "B1-H32-N8192-D96-bf16-causal", "B1-H32-N2048-D80-bf16-causal",  # Phi-3-mini, Phi-2
                 "B2-H8-N4096-D40-bf16-full", "B2-H8-N1024x77-D80-bf16-full",     # SD 1.5 self and cross
                 "B2-H8-N256-D160-bf16-full", "B16-H16-N256-D72-bf16-full"):      # SD 1.5's 4x down, DiT-XL/2
        assert want in keys, want


@pytest.mark.parametrize("name", list(MODELS))
def test_every_model_problem_has_a_family_on_the_h100(name):
    for p in get_model(name).problems("bf16"):
        assert any(f.supports(H100_SXM, p) is None for f in FAMILIES.values()), p.key


def test_seqlen_and_batch():
    llama = get_model("Llama3-8B")
    got = llama.problems("fp16", ["4096", "512:8192"], [1, 4])
    assert [p.key for p in got] == ["B1-H32/kv8-N4096-D128-fp16-causal", "B1-H32/kv8-N512x8192-D128-fp16-causal_br",
                                    "B4-H32/kv8-N4096-D128-fp16-causal", "B4-H32/kv8-N512x8192-D128-fp16-causal_br"]
    for bad, match in (("1024:512", "0 < NQ <= NK"), ("x", "must be N or NQ:NK"), ("1:2:3", "0 < NQ <= NK"),
                       ("0", "0 < NQ <= NK")):
        with pytest.raises(ValueError, match=match):
            llama.problems("bf16", [bad])
    with pytest.raises(ValueError, match="has its own sequence lengths"):
        get_model("whisper").problems("bf16", ["2048"])
    with pytest.raises(ValueError, match="unknown model 'llama9'; known: llama3-8b"):
        get_model("llama9")
    assert model_problems(["llama3-8b", "mistral-7b"], "bf16") == llama.problems("bf16")   # one geometry, once


def test_the_default_set_is_bf16_grid_and_models_on_tensor_core_gpus():
    old = GpuSpec(**{**A100_SXM.to_dict(), "name": "T4", "major": 7, "minor": 5})
    assert default_dtype(H100_SXM) == default_dtype(A100_SXM) == default_dtype(None) == "bf16"
    assert default_dtype(old) == "fp16"
    got = default_problems(None, H100_SXM)
    assert got[:18] == standard_grid("bf16") and set(model_problems(list(MODELS), "bf16")) <= set(got)
    assert len({p.key for p in got}) == len(got) and {p.dtype for p in got} == {"bf16"}
    assert {p.dtype for p in default_problems(None, old)} == {"fp16"}
    assert default_problems("fp32") == list(GPT2_FP32)
