"""The Read and Identify commands end to end on the planted MoE (tests/support/planted_moe.py).

Two "datasets" of traces made of 4-token segments: a segment of behaviour tokens (whose
routing layer 0 sends to the planted experts) is labelled "planning", the other segments
"execution" (and, in dataset b only, a few "reflection"). `read` on each, `identify` on both, all in-process through
`spade_jax.steer.main`; checked against the construction: the planted experts are the
planning set of both datasets and of the shared-experts table, and only the router (not
position or the majority class) reads planning.
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from planted_moe import PLANTED, planted_moe

from spade_jax.models import save_hf
from spade_jax.steer import main
from spade_jax.steering.expert_sets import load_expert_sets
from spade_jax.tokenizers import train_sentencepiece

# The commands end to end (model build, capture, sampling): the slow tier, with the other
# command-line tests.
pytestmark = pytest.mark.slow

BLOCK, BLOCKS, TRACES = 4, 6, 12


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("protocol")
    tokenizer = train_sentencepiece(
        ["what is one plus two three four five six seven eight nine ten answer " * 4,
         "user assistant system\n"], root / "tok" / "sp", vocab_size=300)
    vocab, stops = tokenizer.vocab_size, set(tokenizer.eos_ids)
    ordinary = [t for t in range(vocab) if t not in stops]
    behaviour = {t for t in ordinary if t % 3 == 0}
    successor = {t: ordinary[(ordinary.index(t) + 1) % len(ordinary)] for t in ordinary}
    successor |= {t: ordinary[0] for t in stops}
    model = planted_moe(vocab, behaviour, min(stops), successor)
    save_hf(model, model.config, root / "model")
    # Alphanumeric pieces only: no sentence enders, so the segmenter's cap cuts the blocks.
    plain = [t for t in ordinary if tokenizer.decode([t]).strip(" ").isalnum()]
    pools = ([t for t in plain if t in behaviour], [t for t in plain if t not in behaviour])
    for name, seed in (("a", 0), ("b", 1)):
        rng = np.random.default_rng(seed)
        traces, labels = [], []
        for i in range(TRACES):
            kinds = rng.permutation([0, 0, 0, 1, 1, 1])  # 0: behaviour tokens
            ids = sum((rng.choice(pools[k], BLOCK).tolist() for k in kinds), [])
            traces.append(json.dumps({"trace_id": f"{name}{i}", "token_ids": ids}))
            for s, k in enumerate(kinds):
                # Dataset b also has a few reflection segments: a behaviour only one dataset
                # has, which identify must leave out of every table.
                label = "planning" if k == 0 else \
                    "reflection" if name == "b" and i % 4 == 0 and s == 5 else "execution"
                labels.append(json.dumps({"trace_id": f"{name}{i}", "segment": s,
                                          "label": label}))
        (root / f"{name}.jsonl").write_text("\n".join(traces) + "\n")
        (root / f"{name}_labels.jsonl").write_text("\n".join(labels) + "\n")
    return root


def _read(root, name, out, *extra):
    return main(["read", f"--checkpoint={root / 'model'}",
                 f"--tokenizer={root / 'tok' / 'sp.model'}", f"--traces={root / f'{name}.jsonl'}",
                 f"--labels={root / f'{name}_labels.jsonl'}", f"--out={out}",
                 f"--max_segment_tokens={BLOCK}", "--chunk_tokens=100", "--probe_batch=32",
                 "--epochs=10", *extra])


def _rows(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_read_identify_find_the_planted_experts(world, capsys):
    root = world
    assert _read(root, "a", root / "read_a", "--residual_layers=0,1") == 0
    assert _read(root, "b", root / "read_b") == 0
    capsys.readouterr()

    # Read: the router's layer 0 reads planning; position and the majority class do not.
    rows = {(r["feature_set"], r["layers"]): r for r in _rows(root / "read_a" / "probes.csv")}
    router = float(rows[("router", "L0")]["macro_f1"])
    assert router > float(rows[("majority", "planning")]["macro_f1"]) + 0.15
    assert router > float(rows[("position", "-")]["macro_f1"]) + 0.15
    assert {("residual", "L0"), ("residual_matched", "L0-L1"), ("embeddings", "input"),
            ("tfidf", "segment text"), ("router window", "L0-L1"),
            ("router, first 5 only", "L0")} <= set(rows)
    assert (root / "read_a" / "probes.png").stat().st_size > 0
    assert "| router | L0 |" in (root / "read_a" / "probes.md").read_text()

    # Resume: nothing is recaptured or refitted, the telemetry is untouched.
    manifest = (root / "read_a" / "telemetry" / "manifest.json").read_text()
    assert _read(root, "a", root / "read_a", "--residual_layers=0,1") == 0
    out = capsys.readouterr().out
    assert "capture: " in out and "cached" in out.split("capture: ")[1].splitlines()[0]
    assert "(cached)" in out.split("probe router L0")[1].splitlines()[0]
    assert (root / "read_a" / "telemetry" / "manifest.json").read_text() == manifest

    # Identify on both datasets.
    out_dir = root / "identify"
    assert main(["identify", f"--read=a={root / 'read_a'}", f"--read=b={root / 'read_b'}",
                 f"--out={out_dir}", "--top_n=2", "--sweep=1,2,5",
                 "--permutations=20"]) == 0
    planted = {0: tuple(PLANTED)}
    for name in ("expert_sets_a.json", "expert_sets_b.json", "expert_sets.json"):
        assert load_expert_sets(out_dir / name).sets["planning"] == planted, name
    shared = {r["behaviour"]: r for r in _rows(out_dir / "shared_experts.csv")}
    assert shared["planning"]["experts"] == " ".join(f"L0:{e}" for e in PLANTED)
    # Planning tokens pick the planted pair at layer 0: half of their picks on layers 0-1.
    assert float(shared["planning"]["selection_share_a"]) == pytest.approx(0.5)
    jaccard = {r["behaviour"]: r for r in _rows(out_dir / "jaccard.csv")}
    assert float(jaccard["planning"]["jaccard"]) == 1.0
    sweep = [r for r in _rows(out_dir / "sweep.csv") if r["behaviour"] == "planning"]
    assert all(float(r["auc"]) > 0.99 for r in sweep)
    (left_out,) = [line for line in (out_dir / "identify.md").read_text().splitlines()
                   if line.startswith("- left out")]
    assert "reflection" in left_out and "planning" not in left_out
    for name in ("identify.md", "jaccard.png", "sweep.png", "counts_a.npz",
                 "profile_correlations.csv"):
        assert (out_dir / name).stat().st_size > 0
    # Re-run: the per-dataset counts come from the cache; one dataset skips the
    # cross-dataset tables (and removes the ones an earlier run left).
    capsys.readouterr()
    assert main(["identify", f"--read=a={root / 'read_a'}", f"--out={out_dir}", "--top_n=2",
                 "--layer=0"]) == 0
    assert "counts a: 288 labelled tokens" in capsys.readouterr().out
    assert main(["identify", f"--read=a={root / 'read_a'}", f"--out={out_dir}", "--top_n=2",
                 "--layer=0"]) == 0
    assert "; cached" in capsys.readouterr().out.split("counts a:")[1].splitlines()[0]
    assert "skipped" in (out_dir / "identify.md").read_text()
    assert not (out_dir / "jaccard.csv").exists() and not (out_dir / "sweep.png").exists()
    assert load_expert_sets(out_dir / "expert_sets.json").sets["planning"] == planted
    assert main(["identify", f"--read=a={root / 'read_a'}", f"--out={out_dir}",
                 "--layer=1"]) == 0  # inert layer: a constant profile, still a valid file
    assert main(["identify", f"--read=a={root / 'read_a'}", f"--out={out_dir}",
                 "--layer=2"]) == 2
    assert "--layer 2 is not an MoE layer" in capsys.readouterr().err


def test_token_texts_keep_word_spaces(world):
    """The segmenter sees each token's text with its leading space (a sentence ends at "."
    followed by " x"), and the texts put together are the decoded trace."""
    from spade_jax.steering.commands.read import token_texts
    from spade_jax.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(world / "tok" / "sp.model")
    ids = tokenizer.encode("what is one plus two three four five")
    texts = token_texts(tokenizer, ids)
    assert "".join(texts) == tokenizer.decode(ids)
    assert sum(t.startswith(" ") for t in texts) == 7  # every word but the first


def test_read_labels_with_a_judge_through_the_policy_interface(world):
    """`read --judge`: one judge call per trace labels its segments (here a scripted policy
    answering six labels); what it said is written as a reusable labels file, and a trace
    the answer cannot label (two segments, answered six) is left unlabelled and listed,
    not fatal."""
    root = world
    lines = (root / "a.jsonl").read_text().splitlines()[:4]
    short = json.loads(lines[0])["token_ids"][:2 * BLOCK]
    lines.append(json.dumps({"trace_id": "short", "token_ids": short}))
    (root / "judged.jsonl").write_text("\n".join(lines) + "\n")
    answer = "\n".join(f"{i}: {'planning' if i % 2 else 'execution'}" for i in range(6))
    (root / "judge.json").write_text(json.dumps({"rules": [], "default": answer}))
    out = root / "read_judged"
    args = ["read", f"--checkpoint={root / 'model'}", f"--tokenizer={root / 'tok' / 'sp.model'}",
            f"--traces={root / 'judged.jsonl'}", f"--judge=scripted:{root / 'judge.json'}",
            f"--out={out}", f"--max_segment_tokens={BLOCK}", "--chunk_tokens=100",
            "--probe_batch=32", "--layers=0", "--window=0", "--controls=none"]
    assert main(args) == 0
    judged = [json.loads(line) for line in (out / "labels.jsonl").read_text().splitlines()]
    assert len(judged) == 4 * 6 and {j["trace_id"] for j in judged} == {"a0", "a1", "a2", "a3"}
    assert all(j["label"] == ("planning" if j["segment"] % 2 else "execution") for j in judged)
    prepare = json.loads((out / "stages" / "prepare.json").read_text())
    assert prepare["judge_unlabelled_traces"] == ["short"]
    with np.load(out / "tokens.npz") as tokens:
        assert (tokens["labels"][-2 * BLOCK:] == -1).all()  # the short trace: unlabelled
    assert main([*args[:4], f"--labels={out / 'labels.jsonl'}", *args[5:]]) == 2  # other run
    assert main([a for a in args if not a.startswith("--judge")]) == 2  # neither given


def test_read_and_identify_run_on_the_shared_expert_variant(world):
    """The commands on a Qwen2-MoE-style model (a shared expert beside 8 routed ones): the
    router telemetry and the expert sets cover the routed experts only (the shared expert
    has no router logit, so it is never read, chosen or steered)."""
    from tiny_hf import make_hf_model

    from spade_jax.steering.telemetry import TelemetryReader

    root = world
    make_hf_model("shared", root / "shared", seed=2, vocab_size=300)
    out = root / "read_shared"
    assert main(["read", f"--checkpoint={root / 'shared'}",
                 f"--tokenizer={root / 'tok' / 'sp.model'}", f"--traces={root / 'a.jsonl'}",
                 f"--labels={root / 'a_labels.jsonl'}", f"--out={out}",
                 f"--max_segment_tokens={BLOCK}", "--chunk_tokens=100", "--probe_batch=32",
                 "--window=2", "--controls=majority"]) == 0
    reader = TelemetryReader(out / "telemetry")
    assert reader.metadata["moe_layers"] == [0, 1]
    assert reader.read_chunk(0).router_logits.shape[1:] == (2, 8)  # [N, L, E routed]
    assert {row["feature_set"] for row in _rows(out / "probes.csv")} >= {"router", "majority"}
    assert main(["identify", f"--read=a={out}", f"--out={root / 'identify_shared'}",
                 "--top_n=2", "--permutations=0"]) == 0
    sets = load_expert_sets(root / "identify_shared" / "expert_sets_a.json")
    assert sets.num_experts == 8
    assert all(0 <= e < 8 for layers in sets.sets.values() for ids in layers.values()
               for e in ids)
