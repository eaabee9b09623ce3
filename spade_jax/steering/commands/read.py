"""``python -m spade_jax.steer read``: can the router read out reasoning behaviour?

The paper's Read step as one resumable command: tokenize the traces, cut them into
segments, project the segments' behaviour labels onto tokens, teacher-force the model over
the traces recording router logits (and residual layers, if asked) into telemetry, split
by trace, and fit L2 logistic probes (streamed chunk by chunk) per MoE layer, per window of
consecutive layers, on the residual layers and on the controls. One table holds them all.

    python -m spade_jax.steer read --checkpoint=ckpt/model --traces=traces.jsonl \\
        --labels=labels.jsonl --out=runs/read_gsm8k [--dataset=gsm8k] [--layers=all|0,3,5] \\
        [--window=9] [--residual_layers=8,9,10] [--controls=majority,embeddings,tfidf,
        position,residual_matched,drop_first] [--max_traces=N] [--seed=0]

Inputs:
  --traces  JSONL, one trace per line: {"trace_id": "t1", "text": "..."} or
            {"trace_id": "t1", "token_ids": [..]} (ids of the model's vocabulary).
  --labels  JSONL, one labelled segment per line (spade_jax.steering.labels):
            {"trace_id": "t1", "segment": 3, "label": "planning"}, segment = index within
            the trace as cut by this command's segmenter (--max_segment_tokens; the cut is
            written to OUT/segments.jsonl). A trace with labels needs one for every segment;
            a trace without any stays unlabelled (left out of the probes).
  --judge   instead of --labels: one judge call per trace labels every segment with the
            codebook prompt (spade_jax.steering.labels): "policy" (the --checkpoint model,
            greedy, through the sampler), another model dir, or scripted:FILE.json. What it
            said is written to OUT/labels.jsonl (reusable as --labels); a trace whose answer
            does not label every segment stays unlabelled and is listed in stages/prepare.json.

Outputs in --out:
  read.json           the run's settings (and input digests): a re-run with other ones is
                      refused, naming the argument
  tokens.npz          per token: id, behaviour label (-1: none), global segment id, whether
                      it is among its segment's first five tokens; per trace: offsets, ids
  segments.jsonl      every segment: trace_id, segment, start, end, label, text
  telemetry/          router logits / selected experts (/ residuals) per token, chunked
  stages/*.json       cached stage results: prepare, capture, split, one per probe
  probes.md/.csv/.png the table: feature set, layers, dims, test macro-F1, majority
                      macro-F1, train / test tokens; the plot: macro-F1 per decoder layer,
                      router vs residual, controls as horizontal lines

Resuming: each stage's result is cached under stages/, so a re-run on the same --out skips
what is done; an interrupted capture resumes through the telemetry writer (sequences on disk
are kept, the rest recorded). The tables and plot are rewritten from the cached rows.

Controls (paper section 4): majority (predict the most frequent training class),
embeddings (the model's input-embedding rows), tfidf (TF-IDF of the segment text, fitted on
training segments), position (token position, its log, relative position), residual_matched
(the residual layers' window projected to the width of a router window of as many layers;
needs --residual_layers), drop_first (the best router row's layers with each segment's
first five tokens dropped, and with only those five; "best" by test macro-F1, so it is an
upper reading). Exit status: 0 done, 2 bad input (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from spade_jax.steering import controls, probe
from spade_jax.steering.commands._common import (
    CommandError,
    Progress,
    cached,
    check_run_record,
    file_digest,
    markdown_table,
    new_figure,
    parse_int_list,
    read_json,
    run_command,
    safe_name,
    save_run_record,
    trace_content,
    trace_records,
    write_csv,
)
from spade_jax.steering.labels import (
    BEHAVIOURS,
    label_trace_with_judge,
    labels_for_trace,
    load_labels_jsonl,
)
from spade_jax.steering.segment import (
    SegmenterConfig,
    project_labels_to_tokens,
    segment_length_stats,
    segment_tokens,
    token_segment_ids,
)
from spade_jax.steering.telemetry import MANIFEST, TelemetryChunk, TelemetryReader

CONTROLS = ("majority", "embeddings", "tfidf", "position", "residual_matched", "drop_first")
DEFAULT_CONTROLS = ("majority", "embeddings", "tfidf", "position", "drop_first")
TABLE_COLUMNS = ("feature_set", "layers", "dims", "macro_f1", "majority_macro_f1",
                 "train_tokens", "test_tokens")
NUM_PREFIX = 5  # the paper's "first five tokens" of a segment
_DECODE_WINDOW = 8  # tokens of left context when decoding one token's text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spade_jax.steer read", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="Orbax or HF model dir")
    p.add_argument("--tokenizer", help="tokenizer dir or file (default: the checkpoint dir)")
    p.add_argument("--traces", required=True, help="traces JSONL (trace_id + text|token_ids)")
    p.add_argument("--labels", help="segment labels JSONL (or --judge)")
    p.add_argument("--judge", help="label the segments with a judge instead of --labels: "
                   "'policy' (the --checkpoint model itself, greedy, through the sampler), "
                   "a model dir, or scripted:FILE.json (a scripted policy, for tests)")
    p.add_argument("--judge_max_new_tokens", type=int, default=1024,
                   help="budget of the judge's answer per trace")
    p.add_argument("--out", required=True, help="output dir (re-run to resume)")
    p.add_argument("--dataset", help="dataset name (default: the traces file's stem)")
    p.add_argument("--layers", default="all",
                   help="MoE decoder layers to probe one by one: all or a comma list")
    p.add_argument("--window", type=int, default=9,
                   help="probe windows of this many consecutive probed layers (0: none; "
                        "more than there are: one window of all)")
    p.add_argument("--residual_layers", default="",
                   help="decoder layers whose incoming residual stream is recorded and probed")
    p.add_argument("--controls", default=None,
                   help=f"comma list of {','.join(CONTROLS)} (default: "
                        f"{','.join(DEFAULT_CONTROLS)}, plus residual_matched with "
                        "--residual_layers); 'none' for no controls")
    p.add_argument("--max_traces", type=int, help="first N traces of the file only")
    p.add_argument("--max_segment_tokens", type=int, default=125, help="segment length cap")
    p.add_argument("--chunk_tokens", type=int, default=65536, help="tokens per telemetry chunk")
    p.add_argument("--batch_size", type=int, default=8, help="traces per forward pass")
    p.add_argument("--test_fraction", type=float, default=0.25, help="traces held out")
    p.add_argument("--epochs", type=int, default=5, help="streaming probe epochs")
    p.add_argument("--probe_batch", type=int, default=1024, help="probe minibatch (tokens)")
    p.add_argument("--l2", type=float, default=1e-3, help="probe L2 weight")
    p.add_argument("--class_weighting", default="none", choices=probe.CLASS_WEIGHTINGS)
    p.add_argument("--seed", type=int, default=0, help="split, probe shuffling, projection")
    return p


@dataclasses.dataclass(frozen=True)
class Trace:
    trace_id: str
    text: str | None
    token_ids: tuple[int, ...] | None


def load_traces(path: Path, max_traces: int | None) -> tuple[list[Trace], set[str]]:
    """The first ``max_traces`` traces, and every trace id in the file (a label naming a
    trace past the limit is not an error). Errors name the file and line."""
    if not path.is_file():
        raise CommandError(f"--traces {path}: no such file")
    traces: list[Trace] = []
    all_ids: set[str] = set()
    for where, trace_id, obj in trace_records(path):
        all_ids.add(trace_id)
        text, ids = trace_content(where, trace_id, obj)
        if max_traces is None or len(traces) < max_traces:
            traces.append(Trace(trace_id, text, ids))
    if not traces:
        raise CommandError(f"--traces {path}: no traces")
    return traces, all_ids


def token_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The text each token adds: decode of a short left window with and without the token.

    Why not ``decode([t])``: sentencepiece drops a word's leading space when it decodes a
    token alone, and the segmenter needs that space (a "." followed by " x" ends a sentence,
    "3.5" does not)."""
    texts = []
    for i in range(len(ids)):
        start = max(0, i - _DECODE_WINDOW)
        before = tokenizer.decode(list(ids[start:i])) if i > start else ""
        upto = tokenizer.decode(list(ids[start:i + 1]))
        if not upto.startswith(before):  # a multi-byte character completed by this token
            before = os.path.commonprefix([before, upto])
        texts.append(upto[len(before):])
    return texts


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    if (args.labels is None) == (args.judge is None):
        raise CommandError("give exactly one of --labels (a labels file) or --judge (policy, "
                           "a model dir or scripted:FILE.json)")
    traces = Path(args.traces)
    labels = Path(args.labels) if args.labels is not None else None
    for flag, path in (("--traces", traces), ("--labels", labels)):
        if path is not None and not path.is_file():
            raise CommandError(f"{flag} {path}: no such file")
    judge, judge_digest = args.judge, None
    if judge is not None:
        if judge.startswith("scripted:"):
            script = Path(judge.removeprefix("scripted:"))
            if not script.is_file():
                raise CommandError(f"--judge {judge}: no such script file")
            judge, judge_digest = f"scripted:{script.resolve()}", file_digest(script)
        elif judge != "policy":
            if not Path(judge).is_dir():
                raise CommandError(f"--judge {judge}: not 'policy', scripted:FILE.json or a "
                                   f"model directory")
            judge = str(Path(judge).resolve())
        if args.judge_max_new_tokens < 1:
            raise CommandError("--judge_max_new_tokens must be >= 1")
    if not Path(args.checkpoint).exists():
        raise CommandError(f"--checkpoint {args.checkpoint}: no such directory")
    if args.max_traces is not None and args.max_traces < 1:
        raise CommandError("--max_traces must be >= 1")
    if args.window < 0 or min(args.epochs, args.batch_size, args.probe_batch) < 1:
        raise CommandError("--window must be >= 0, --epochs, --batch_size and --probe_batch >= 1")
    residual_layers = parse_int_list(args.residual_layers, "--residual_layers")
    if args.controls is None:
        chosen = DEFAULT_CONTROLS + (("residual_matched",) if residual_layers else ())
    elif args.controls.strip() == "none":
        chosen = ()
    else:
        chosen = tuple(c.strip() for c in args.controls.split(",") if c.strip())
        unknown = [c for c in chosen if c not in CONTROLS]
        if unknown:
            raise CommandError(f"--controls: unknown {unknown}; choose from {CONTROLS}")
    if "residual_matched" in chosen and not residual_layers:
        raise CommandError("--controls=residual_matched needs --residual_layers")
    layers = "all" if args.layers.strip() == "all" else \
        list(parse_int_list(args.layers, "--layers"))
    if layers != "all" and not layers:
        raise CommandError("--layers: give 'all' or at least one layer")
    return {
        "checkpoint": str(Path(args.checkpoint).resolve()),
        "tokenizer": str(Path(args.tokenizer).resolve()) if args.tokenizer else None,
        "traces": str(traces.resolve()), "traces_sha256": file_digest(traces),
        "labels": str(labels.resolve()) if labels else None,
        "labels_sha256": file_digest(labels) if labels else None,
        "judge": judge, "judge_sha256": judge_digest,
        "judge_max_new_tokens": args.judge_max_new_tokens if judge else None,
        "dataset": args.dataset or traces.stem, "layers": layers, "window": args.window,
        "residual_layers": list(residual_layers), "controls": list(chosen),
        "max_traces": args.max_traces, "max_segment_tokens": args.max_segment_tokens,
        "chunk_tokens": args.chunk_tokens, "batch_size": args.batch_size,
        "test_fraction": args.test_fraction, "epochs": args.epochs,
        "probe_batch": args.probe_batch, "l2": args.l2,
        "class_weighting": args.class_weighting, "seed": args.seed,
    }


# ---------------------------------------------------------------- stage 1: prepare


def _load_tokenizer(settings: dict[str, Any]) -> Any:
    from spade_jax.tokenizers import load_tokenizer

    return load_tokenizer(settings["tokenizer"] or settings["checkpoint"])


def prepare(settings: dict[str, Any], out: Path) -> dict[str, Any]:
    """Tokenize, segment, project labels; writes tokens.npz and segments.jsonl."""
    traces, all_ids = load_traces(Path(settings["traces"]), settings["max_traces"])
    judge = None
    if settings["labels"] is not None:
        records = load_labels_jsonl(settings["labels"])
    else:
        records, judge = [], _build_judge(settings)
    judged: list[str] = []  # judge output lines of labels.jsonl
    unjudged: list[str] = []  # traces the judge's answer did not label (left unlabelled)
    unknown = sorted({r.trace_id for r in records} - all_ids)
    if unknown:
        raise CommandError(f"--labels {settings['labels']}: label(s) for unknown trace(s) "
                           f"{unknown[:5]}{' ...' if len(unknown) > 5 else ''} (not in "
                           f"{settings['traces']})")
    by_trace: dict[str, list] = {}
    for record in records:
        by_trace.setdefault(record.trace_id, []).append(record)
    tokenizer = _load_tokenizer(settings)
    config = SegmenterConfig(max_tokens=settings["max_segment_tokens"])
    ids_n, labels_n, segments_n, prefix_n, offsets = [], [], [], [], [0]
    all_segments, lines = [], []
    for trace in traces:
        ids = list(trace.token_ids) if trace.token_ids is not None else tokenizer.encode(trace.text)
        if not ids:
            raise CommandError(f"trace {trace.trace_id!r}: the text encodes to no tokens")
        if max(ids) >= tokenizer.vocab_size:
            raise CommandError(f"trace {trace.trace_id!r}: token ids outside the tokenizer's "
                               f"vocabulary [0, {tokenizer.vocab_size})")
        texts = token_texts(tokenizer, ids)
        segments = segment_tokens(texts, config)
        trace_records = by_trace.get(trace.trace_id)
        if judge is not None:
            seg_labels = _judge_trace(judge, trace.trace_id, [
                "".join(texts[seg.start:seg.end]) for seg in segments], judged, unjudged)
        else:
            seg_labels = (labels_for_trace(trace_records, trace.trace_id, len(segments))
                          if trace_records else [-1] * len(segments))
        base = len(all_segments)
        local_t = token_segment_ids(segments, len(ids))
        ids_n.append(np.asarray(ids, np.int32))
        labels_n.append(project_labels_to_tokens(segments, seg_labels, len(ids)))
        segments_n.append(local_t + base)
        prefix_n.append(controls.prefix_mask(local_t, NUM_PREFIX))
        offsets.append(offsets[-1] + len(ids))
        for index, (segment, label) in enumerate(zip(segments, seg_labels, strict=True)):
            text = "".join(texts[segment.start:segment.end])
            all_segments.append(segment)
            lines.append(json.dumps({
                "trace_id": trace.trace_id, "segment": index, "start": segment.start,
                "end": segment.end, "label": BEHAVIOURS[label] if label >= 0 else None,
                "text": text}))
    (out / "segments.jsonl").write_text("\n".join(lines) + "\n")
    if judge is not None:  # what the judge said, in the --labels format (reusable)
        (out / "labels.jsonl").write_text("".join(line + "\n" for line in judged))
    labels_all = np.concatenate(labels_n)
    np.savez(out / "tokens.npz", trace_ids=np.array([t.trace_id for t in traces]),
             offsets=np.asarray(offsets, np.int64), token_ids=np.concatenate(ids_n),
             labels=labels_all, segment_ids=np.concatenate(segments_n),
             prefix=np.concatenate(prefix_n))
    counts_c = np.bincount(labels_all[labels_all >= 0], minlength=len(BEHAVIOURS))
    if not counts_c.any():
        raise CommandError("no trace has labels; nothing to probe" + (
            f" (the judge labelled none of {len(traces)} traces)" if judge is not None else ""))
    extra = ({"judge_unlabelled_traces": unjudged} if judge is not None else {})
    return {**extra, "traces": len(traces), "tokens": int(offsets[-1]), "segments": len(all_segments),
            "labelled_tokens": dict(zip(BEHAVIOURS, counts_c.tolist(), strict=True)),
            "segment_lengths": segment_length_stats(all_segments)}


def _build_judge(settings: dict[str, Any]) -> Any:
    """The segment judge: the policy itself, another model, or a scripted policy, greedy
    through the same sampler (`evaluation.load_policy`)."""
    from spade_jax.evaluation.policy import SamplerPolicyConfig, load_policy
    from spade_jax.steering.labels import PolicyJudge, PolicyJudgeConfig

    spec = settings["judge"]
    greedy = SamplerPolicyConfig(temperature=0.0, top_p=1.0)
    try:
        if spec.startswith("scripted:"):
            policy = load_policy(policy=spec)
        elif spec == "policy":
            policy = load_policy(settings["checkpoint"], tokenizer=settings["tokenizer"],
                                 config=greedy)
        else:
            policy = load_policy(spec, config=greedy)
    except ValueError as err:
        raise CommandError(f"--judge: {err}") from None
    return PolicyJudge(policy, PolicyJudgeConfig(
        max_new_tokens=settings["judge_max_new_tokens"], seed=settings["seed"]))


def _judge_trace(judge: Any, trace_id: str, segment_texts: list[str], judged: list[str],
                 unjudged: list[str]) -> list[int]:
    """One judge call labels every segment of a trace; an answer that does not label each
    segment exactly once leaves the trace unlabelled (listed in the stage result), rather
    than stopping a long labelling run."""
    try:
        labels = label_trace_with_judge(judge, segment_texts)
    except ValueError:
        unjudged.append(trace_id)
        return [-1] * len(segment_texts)
    judged.extend(json.dumps({"trace_id": trace_id, "segment": i, "label": BEHAVIOURS[c]})
                  for i, c in enumerate(labels))
    return labels


@dataclasses.dataclass(frozen=True)
class TokenTable:
    """tokens.npz: per-token labels / segment ids looked up by (sequence id, position)."""

    trace_ids: np.ndarray
    offsets: np.ndarray
    token_ids: np.ndarray
    labels: np.ndarray
    segment_ids: np.ndarray
    prefix: np.ndarray

    @classmethod
    def load(cls, path: Path) -> TokenTable:
        if not path.is_file():
            raise CommandError(f"{path}: missing (run `read` on this directory first)")
        with np.load(path) as data:
            return cls(*(data[f.name] for f in dataclasses.fields(cls)))

    def rows(self, chunk: TelemetryChunk) -> np.ndarray:
        """Index of each telemetry token in the table; checks the token ids agree."""
        rows_n = self.offsets[chunk.sequence_ids] + chunk.positions
        if (self.token_ids[rows_n] != chunk.token_ids).any():
            raise CommandError("telemetry tokens differ from tokens.npz (mixed runs?)")
        return rows_n

    def labels_of(self, chunk: TelemetryChunk) -> np.ndarray:
        return self.labels[self.rows(chunk)]

    def segments_of(self, chunk: TelemetryChunk) -> np.ndarray:
        return self.segment_ids[self.rows(chunk)]

    def prefix_of(self, chunk: TelemetryChunk) -> np.ndarray:
        return self.prefix[self.rows(chunk)]

    @property
    def trace_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sequences(self) -> list[np.ndarray]:
        return [self.token_ids[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:],
                                                    strict=True)]


# ---------------------------------------------------------------- stage 2: capture


class ModelHolder:
    """Loads the model the first time a stage needs it (a fully cached re-run never does)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self._model = None

    def get(self) -> Any:
        if self._model is None:
            from spade_jax.evaluation import load_policy

            self._model = load_policy(self.settings["checkpoint"],
                                      tokenizer=self.settings["tokenizer"]).model
        return self._model


def moe_rows(moe_layers: Sequence[int], layers: str | list[int]) -> list[int]:
    """Telemetry rows of the probed layers (``layers``: decoder indices, or "all")."""
    if layers == "all":
        return list(range(len(moe_layers)))
    bad = [layer for layer in layers if layer not in moe_layers]
    if bad:
        raise CommandError(f"--layers {bad} are not MoE layers of the model "
                           f"(MoE layers: {list(moe_layers)})")
    return sorted(list(moe_layers).index(layer) for layer in layers)


def capture(settings: dict[str, Any], out: Path, table: TokenTable, model: ModelHolder,
            progress: Progress) -> dict[str, Any]:
    """Teacher-forced router (+ residual) telemetry; resumes an interrupted capture."""
    from spade_jax.steering.capture import CaptureConfig, moe_layer_indices, score_and_record
    from spade_jax.steering.telemetry import TelemetryWriter

    net = model.get()
    moe_rows(moe_layer_indices(net), settings["layers"])  # raises: no MoE layers, bad --layers
    residual = tuple(settings["residual_layers"])
    if residual and max(residual) >= net.config.num_layers:
        raise CommandError(f"--residual_layers {list(residual)} must be in "
                           f"[0, {net.config.num_layers})")
    directory = out / "telemetry"
    config = CaptureConfig(batch_size=settings["batch_size"], residual_layers=residual)
    sequences = table.sequences()
    group = max(64, settings["batch_size"])
    with TelemetryWriter(directory, chunk_tokens=settings["chunk_tokens"],
                         resume=(directory / MANIFEST).exists()) as writer:
        skipped = len(writer.resumed_sequence_ids)
        for start in range(0, len(sequences), group):
            ids = list(range(start, min(start + group, len(sequences))))
            written = score_and_record(net, [sequences[i] for i in ids], writer,
                                       sequence_ids=ids, config=config)
            if len(sequences) > group:
                progress.done("capture (part)", written, "tokens",
                              f"traces {start}..{ids[-1]}")
    reader = TelemetryReader(directory)
    return {"tokens": reader.num_tokens, "traces_resumed": skipped,
            "moe_layers": reader.metadata["moe_layers"],
            "hidden_size": int(net.config.hidden_size)}


# ---------------------------------------------------------------- stage 3: probes


@dataclasses.dataclass(frozen=True)
class FeatureSet:
    """One probe row: how to turn a telemetry chunk into features (and which tokens count)."""

    name: str
    layers: str
    dims: int
    features: Callable[[TelemetryChunk], np.ndarray]
    residuals: bool = False
    keep: Callable[[TelemetryChunk], np.ndarray] | None = None
    plot_layer: int | None = None  # decoder layer of a single-layer row (the plot's x)
    kind: str = "router"  # router | residual | control


def _layer_label(layers: Sequence[int]) -> str:
    return f"L{layers[0]}" if len(layers) == 1 else f"L{layers[0]}-L{layers[-1]}"


def router_feature_sets(moe_layers: Sequence[int], rows: Sequence[int], window: int,
                        num_experts: int) -> list[FeatureSet]:
    """One row per probed MoE layer, then windows of ``window`` consecutive probed layers."""
    def router(rows_w: Sequence[int]) -> Callable[[TelemetryChunk], np.ndarray]:
        return lambda c: probe.centered_router_features(c.router_logits, rows_w)

    sets = [FeatureSet("router", _layer_label([moe_layers[r]]), num_experts, router([r]),
                       plot_layer=moe_layers[r]) for r in rows]
    if window >= 2 and len(rows) >= 2:
        width = min(window, len(rows))
        for start in range(len(rows) - width + 1):
            rows_w = list(rows[start:start + width])
            sets.append(FeatureSet("router window", _layer_label([moe_layers[r] for r in rows_w]),
                                   width * num_experts, router(rows_w)))
    return sets


def residual_feature_sets(residual_layers: Sequence[int], hidden: int) -> list[FeatureSet]:
    def residual(rows: Sequence[int]) -> Callable[[TelemetryChunk], np.ndarray]:
        return lambda c: probe.residual_window_features(c.residuals, rows)

    sets = [FeatureSet("residual", f"L{layer}", hidden, residual([r]), residuals=True,
                       plot_layer=layer, kind="residual")
            for r, layer in enumerate(residual_layers)]
    if len(residual_layers) > 1:
        rows = list(range(len(residual_layers)))
        sets.append(FeatureSet("residual window", _layer_label(list(residual_layers)),
                               len(rows) * hidden, residual(rows), residuals=True,
                               kind="residual"))
    return sets


def control_feature_sets(settings: dict[str, Any], out: Path, table: TokenTable,
                         train_ids: np.ndarray, reader: TelemetryReader,
                         model: ModelHolder, hidden: int) -> list[FeatureSet]:
    """embeddings / tfidf / position / residual_matched (majority and drop_first are
    built from the other rows)."""
    chosen, sets = settings["controls"], []
    if "embeddings" in chosen:
        def embed(c: TelemetryChunk) -> np.ndarray:
            return controls.input_embedding_features(model.get(), c.token_ids)

        sets.append(FeatureSet("embeddings", "input", hidden, embed, kind="control"))
    if "tfidf" in chosen:
        segments = [json.loads(line) for line in (out / "segments.jsonl").read_text().splitlines()]
        trace_index = {str(t): i for i, t in enumerate(table.trace_ids.tolist())}
        train = set(train_ids.tolist())
        texts = [s["text"] for s in segments
                 if s["label"] is not None and trace_index[s["trace_id"]] in train]
        tfidf = controls.fit_tfidf(texts)
        all_texts = [s["text"] for s in segments]

        def tfidf_features(c: TelemetryChunk) -> np.ndarray:
            unique, inverse = np.unique(table.segments_of(c), return_inverse=True)
            return tfidf.transform([all_texts[s] for s in unique])[inverse.reshape(-1)]

        sets.append(FeatureSet("tfidf", "segment text", len(tfidf.vocabulary), tfidf_features,
                               kind="control"))
    if "position" in chosen:
        lengths = table.trace_lengths
        sets.append(FeatureSet(
            "position", "-", 3,
            lambda c: controls.position_features(c.positions, lengths[c.sequence_ids]),
            kind="control"))
    if "residual_matched" in chosen:
        num_rows, hidden = reader.residual_shape
        width = num_rows * reader.num_experts
        kind = "orthonormal" if num_rows * hidden >= width else "gaussian"
        projection = controls.width_matched_projection(num_rows * hidden, reader.num_experts,
                                                       num_rows, seed=settings["seed"], kind=kind)
        rows = list(range(num_rows))
        sets.append(FeatureSet(
            "residual_matched", _layer_label(list(reader.residual_layers)), width,
            lambda c: controls.project_features(probe.residual_window_features(c.residuals, rows),
                                                projection),
            residuals=True, kind="control"))
    return sets


def fit_and_score(settings: dict[str, Any], directory: Path, table: TokenTable,
                  feature_set: FeatureSet, train_ids: np.ndarray,
                  test_ids: np.ndarray) -> dict[str, Any]:
    """Streamed fit on the training traces, confusion-matrix macro-F1 on the test traces."""
    keep = feature_set.keep or (lambda c: np.ones(len(c.token_ids), bool))

    def source(ids: np.ndarray):
        return probe.telemetry_feature_chunks(
            directory, feature_set.features, table.labels_of,
            weights=lambda c: np.isin(c.sequence_ids, ids) & keep(c),
            residuals=feature_set.residuals)

    config = probe.StreamingProbeConfig(
        l2=settings["l2"], num_epochs=settings["epochs"], batch_size=settings["probe_batch"],
        seed=settings["seed"],
        class_weighting=settings["class_weighting"])
    fit = probe.fit_streaming_probe(source(train_ids), feature_set.dims, len(BEHAVIOURS), config)
    evaluation = probe.evaluate_streaming_probe(
        fit.params, source(test_ids), len(BEHAVIOURS),
        majority_class=int(fit.class_counts_c.argmax()))
    return {"feature_set": feature_set.name, "layers": feature_set.layers,
            "dims": feature_set.dims, "macro_f1": evaluation.macro_f1,
            "majority_macro_f1": evaluation.majority_macro_f1, "train_tokens": fit.num_train,
            "test_tokens": evaluation.num_tokens, "kind": feature_set.kind,
            "plot_layer": feature_set.plot_layer}


def majority_row(table: TokenTable, train_ids: np.ndarray, test_ids: np.ndarray) -> dict:
    trace_n = np.repeat(np.arange(len(table.trace_lengths)), table.trace_lengths)
    labelled = table.labels >= 0
    train = labelled & np.isin(trace_n, train_ids)
    test = labelled & np.isin(trace_n, test_ids)
    majority = int(np.bincount(table.labels[train], minlength=len(BEHAVIOURS)).argmax())
    confusion = np.zeros((len(BEHAVIOURS),) * 2, np.int64)
    confusion[:, majority] = np.bincount(table.labels[test], minlength=len(BEHAVIOURS))
    score = probe.macro_f1_from_confusion(confusion)
    return {"feature_set": "majority", "layers": BEHAVIOURS[majority], "dims": 0,
            "macro_f1": score, "majority_macro_f1": score, "train_tokens": int(train.sum()),
            "test_tokens": int(test.sum()), "kind": "control", "plot_layer": None}


def split_traces(settings: dict[str, Any], table: TokenTable) -> dict[str, list[int]]:
    """Train / test traces (group split: a trace's tokens never straddle the two)."""
    trace_n = np.repeat(np.arange(len(table.trace_lengths)), table.trace_lengths)
    labelled = np.unique(trace_n[table.labels >= 0])
    if labelled.size < 2:
        raise CommandError(f"need at least 2 labelled traces to split, got {labelled.size}")
    train, test = probe.group_split(labelled, settings["test_fraction"], settings["seed"])
    return {"train": labelled[train].tolist(), "test": labelled[test].tolist()}


def run_probes(settings: dict[str, Any], out: Path, table: TokenTable, model: ModelHolder,
               captured: dict[str, Any], progress: Progress) -> list[dict[str, Any]]:
    directory = out / "telemetry"
    reader = TelemetryReader(directory)
    moe_layers = reader.metadata["moe_layers"]
    rows = moe_rows(moe_layers, settings["layers"])
    split, _ = cached(out / "stages" / "split.json", lambda: split_traces(settings, table))
    train_ids, test_ids = np.asarray(split["train"]), np.asarray(split["test"])
    sets = router_feature_sets(moe_layers, rows, settings["window"], reader.num_experts)
    if settings["residual_layers"]:
        sets += residual_feature_sets(reader.residual_layers, reader.residual_shape[1])
    sets += control_feature_sets(settings, out, table, train_ids, reader, model,
                                 captured["hidden_size"])
    results = []

    def run(feature_set: FeatureSet) -> dict[str, Any]:
        path = out / "stages" / f"probe_{safe_name(feature_set.name)}_{safe_name(feature_set.layers)}.json"
        row, reused = cached(path, lambda: fit_and_score(settings, directory, table, feature_set,
                                                         train_ids, test_ids))
        progress.done(f"probe {feature_set.name} {feature_set.layers}", row["train_tokens"],
                      "train tokens", f"macro-F1 {row['macro_f1']:.3f}"
                      + (" (cached)" if reused else ""))
        return row

    for feature_set in sets:
        results.append(run(feature_set))
    if "drop_first" in settings["controls"]:
        best = max((r for r in results if r["kind"] == "router"), key=lambda r: r["macro_f1"])
        best_set = next(s for s in sets if s.kind == "router" and s.layers == best["layers"])
        trace_n = np.repeat(np.arange(len(table.trace_lengths)), table.trace_lengths)
        for name, keep_n, keep in (
                (f"router, first {NUM_PREFIX} dropped", ~table.prefix, lambda c: ~table.prefix_of(c)),
                (f"router, first {NUM_PREFIX} only", table.prefix, table.prefix_of)):
            usable = keep_n & (table.labels >= 0)
            if not all((usable & np.isin(trace_n, ids)).any() for ids in (train_ids, test_ids)):
                print(f"[read] {name}: skipped, no labelled token left in the train or test "
                      f"traces (segments of at most {NUM_PREFIX} tokens?)")
                continue
            results.append(run(dataclasses.replace(best_set, name=name, keep=keep,
                                                   kind="control", plot_layer=None)))
    if "majority" in settings["controls"]:
        results.append(majority_row(table, train_ids, test_ids))
    return results


# ---------------------------------------------------------------- report


def write_report(out: Path, rows: list[dict[str, Any]], title: str, notes: Sequence[str]) -> None:
    (out / "probes.md").write_text(
        f"# Read: {title}\n\n" + "".join(f"{n}\n" for n in notes) + "\n"
        + markdown_table(rows, TABLE_COLUMNS))
    write_csv(out / "probes.csv", rows, TABLE_COLUMNS)
    plt, fig, ax = new_figure(8.0, 4.5, legend_right=2.4)
    for kind, style in (("router", "o-"), ("residual", "s-")):
        points = sorted((r["plot_layer"], r["macro_f1"]) for r in rows
                        if r["kind"] == kind and r["plot_layer"] is not None)
        if points:
            ax.plot(*zip(*points, strict=True), style, label=f"{kind} (one layer)")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    others = [r for r in rows if r["plot_layer"] is None]
    for i, row in enumerate(others):
        ax.axhline(row["macro_f1"], linestyle="--", linewidth=1,
                   color=colours[(i + 2) % len(colours)],
                   label=f"{row['feature_set']} {row['layers']}")
    ax.set_xlabel("decoder layer")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("test macro-F1")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7)
    fig.savefig(out / "probes.png", dpi=100)
    plt.close(fig)


def _read(args: argparse.Namespace) -> None:
    settings = _settings(args)
    out = Path(args.out)
    recorded = check_run_record(out / "read.json", settings, "read")
    progress = Progress("read")
    stages = out / "stages"
    out.mkdir(parents=True, exist_ok=True)
    summary, reused = cached(stages / "prepare.json", lambda: prepare(settings, out))
    if not recorded:  # only once the inputs passed: a fixed input file may then be re-run
        save_run_record(out / "read.json", settings, "read")
    progress.done("prepare", summary["tokens"], "tokens",
                  f"{summary['traces']} traces, {summary['segments']} segments"
                  + (" (cached)" if reused else ""))
    table = TokenTable.load(out / "tokens.npz")
    model = ModelHolder(settings)
    marker = stages / "capture.json"
    manifest = out / "telemetry" / MANIFEST
    if marker.exists() and manifest.exists() and TelemetryReader(out / "telemetry").complete:
        captured = read_json(marker)
        progress.done("capture", captured["tokens"], "tokens", "cached")
    else:
        marker.unlink(missing_ok=True)
        captured, _ = cached(marker, lambda: capture(settings, out, table, model, progress))
        progress.done("capture", captured["tokens"], "tokens")
    rows = run_probes(settings, out, table, model, captured, progress)
    counts = summary["labelled_tokens"]
    notes = [f"- dataset {settings['dataset']}: {summary['traces']} traces, {summary['tokens']} "
             f"tokens, {summary['segments']} segments (median length "
             f"{summary['segment_lengths']['median']:.0f} tokens)",
             "- labelled tokens: " + ", ".join(f"{k} {v}" for k, v in counts.items()),
             "- split by trace; probes fitted on the train traces, scored on the test traces"]
    write_report(out, rows, settings["dataset"], notes)
    progress.done("report", len(rows), "rows", f"{out / 'probes.md'}")
    print(markdown_table(rows, TABLE_COLUMNS))


def main(argv: Sequence[str]) -> int:
    """``read`` entry point: 0 done, 2 bad input (``error: ...`` on stderr)."""
    return run_command(build_parser(), argv, _read)
