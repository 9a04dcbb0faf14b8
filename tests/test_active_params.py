"""Active parameters as the model cards count them (issue 12, item 7).

The cards disagree on one term, the input embedding table (a token reads one row of it):

- gpt-oss (OpenAI's model card, "Table 1"): active parameters leave the embedding out and
  count the unembedding: gpt-oss-120b 5.13B active of 116.83B, gpt-oss-20b 3.61B of 20.91B;
- Qwen3 ("3.3B activated" for Qwen3-30B-A3B, "22B" for Qwen3-235B-A22B), Mixtral ("12.9B
  active"), Llama 4 Scout ("17B active"), DeepSeek-V3 ("37B activated"): the embedding
  counted, as ``ModelGeometry.active_params`` counted it for every family.
"""

import pytest

from moefit.ingest.resolve import load_model



@pytest.mark.parametrize("name,total,active", [
    ("gpt-oss-120b", 116.83, 5.13),     # the card's table: 116.83B total, 5.13B active
    ("gpt-oss-20b", 20.91, 3.61),       # 20.91B total, 3.61B active
    ("Qwen3-30B-A3B", 30.53, 3.35),     # card: 30.5B total, 3.3B activated
    ("Mixtral-8x7B-v0.1", 46.70, 12.88),  # card: 46.7B total, 12.9B active
])
def test_active_params_match_the_model_card(name, total, active):
    g = load_model(name)
    assert round(g.total_params / 1e9, 2) == total
    assert round(g.active_params / 1e9, 2) == active


def test_gpt_oss_active_leaves_out_exactly_the_embedding_table():
    g = load_model("gpt-oss-20b")
    embed = next(t for t in g.global_tensors if t.role == "embed")
    assert embed.shape == (201088, 2880)
    per_token = sum(t.numel for t in g.global_tensors if t.role != "embed")
    for l in g.layers:
        per_token += sum(t.numel for t in l.tensors)
        per_token += l.moe.experts_per_token * sum(t.numel for t in l.expert_tensors)
    assert g.active_params == per_token


def test_models_table_says_what_active_counts(capsys):
    from moefit.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "active" in out
    footer = "\n".join(l for l in out.splitlines() if "active" in l.lower() and "embedding" in l.lower())
    assert "gpt-oss" in footer, out
