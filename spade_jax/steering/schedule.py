"""First-answer detectors for the "steer only after the first answer" schedule.

The paper's cut experiment finds that suppressing planning experts acts almost entirely
after the model first states an answer (median 8-21% into the trace); before that point the
edit barely changes anything. The sampler keeps a per-sequence ``active`` flag, sets it when
a detector fires, and passes it to the steering hook. Once set it stays set: the window
experiment shows releasing the clamp brings the postponed rechecks straight back.

Detectors:
  * :class:`FirstAnswerTracker` -- host side, regexes over decoded text, streamed chunk by
    chunk (keeps a short tail so a pattern split across chunks is still found);
  * :class:`TokenPatternDetector` -- device side, pure jnp, fires when the generated token
    ids end with one of a few token-id patterns (e.g. the ids of "\\boxed{");
  * :class:`TextMarkerDetector` -- device side, pure jnp: a character automaton for a small
    regex subset (the text tracker's markers, :data:`DEVICE_ANSWER_PATTERNS`) lifted to
    token ids, so it fires at the token where the marker's text completes however the
    tokenizer split it (the ``run`` command's first-answer detector);
  * :class:`TokenCountDetector` -- device side, fires once W tokens were generated (the
    "window" schedule: clamp the first W generated tokens, then release).

Every device detector has ``init(B) -> state``, ``update(state, token_b) -> state`` and a
sticky bool ``state.fired_b`` [B]; the sampler updates it once per generated token and
hands ``fired_b`` to the hook as ``active``. :func:`detector_for_schedule` picks the one a
schedule needs.
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_ANSWER_PATTERNS: tuple[str, ...] = (
    r"\\boxed\{",
    r"(?i)\b(?:the\s+)?final\s+answer\s*(?:is|:)",
    r"(?i)\bthe\s+answer\s+is\b",
    r"(?i)\*\*answer\*\*",
    r"(?im)^\s*answer\s*:",
)


@dataclasses.dataclass(frozen=True)
class FirstAnswerConfig:
    """Text patterns that mark a stated answer.

    Attributes:
      patterns: regular expressions; the first match anywhere in the generated text fires.
      lookback_chars: characters of previous text kept when streaming, so a pattern cut in
        half by a chunk boundary is still matched; must exceed the longest pattern match.
    """

    patterns: tuple[str, ...] = DEFAULT_ANSWER_PATTERNS
    lookback_chars: int = 64

    def __post_init__(self) -> None:
        if not self.patterns:
            raise ValueError("patterns must not be empty")
        for pattern in self.patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"invalid answer pattern {pattern!r}: {err}") from None
        if self.lookback_chars < 1:
            raise ValueError(f"lookback_chars must be >= 1, got {self.lookback_chars}")


def find_first_answer(text: str, config: FirstAnswerConfig = FirstAnswerConfig()) -> int | None:
    """Character offset just past the earliest answer marker in ``text``, or None."""
    matches = [m for p in config.patterns if (m := re.search(p, text)) is not None]
    if not matches:
        return None
    earliest = min(matches, key=lambda m: (m.start(), m.end()))
    return earliest.end()


class FirstAnswerTracker:
    """Per-sequence sticky "first answer seen" flags over streamed decoded text."""

    def __init__(self, batch_size: int, config: FirstAnswerConfig = FirstAnswerConfig()):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.config = config
        self._patterns = [re.compile(p) for p in config.patterns]
        self._tails = [""] * batch_size
        self.fired = np.zeros(batch_size, bool)

    def update(self, new_text_b: list[str]) -> np.ndarray:
        """Feeds each sequence's newly decoded text; returns the bool ``[B]`` active flags."""
        if len(new_text_b) != len(self._tails):
            raise ValueError(f"expected {len(self._tails)} texts, got {len(new_text_b)}")
        for b, new_text in enumerate(new_text_b):
            if self.fired[b]:
                continue
            window = self._tails[b] + new_text
            if any(p.search(window) for p in self._patterns):
                self.fired[b] = True
            self._tails[b] = window[-self.config.lookback_chars :]
        return self.fired.copy()


class TokenPatternState(NamedTuple):
    recent_bm: jax.Array  # last m generated token ids per sequence, newest last; -1 = none
    fired_b: jax.Array  # sticky bool flag per sequence


@dataclasses.dataclass(frozen=True)
class TokenPatternDetector:
    """Fires when a sequence's generated ids end with any of ``patterns`` (pure, jit-able).

    Attributes:
      patterns: token-id sequences, e.g. the tokenisation of "\\boxed{" and " answer is".
    """

    patterns: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not self.patterns or any(len(p) == 0 for p in self.patterns):
            raise ValueError("patterns must be a non-empty tuple of non-empty id sequences")
        if any(t < 0 for p in self.patterns for t in p):
            raise ValueError("token ids in patterns must be >= 0")

    @property
    def window(self) -> int:
        return max(len(p) for p in self.patterns)

    def init(self, batch_size: int) -> TokenPatternState:
        return TokenPatternState(
            recent_bm=jnp.full((batch_size, self.window), -1, jnp.int32),
            fired_b=jnp.zeros((batch_size,), bool),
        )

    def update(self, state: TokenPatternState, token_b: jax.Array) -> TokenPatternState:
        """Appends one generated token per sequence and updates the sticky flags."""
        recent_bm = jnp.concatenate(
            [state.recent_bm[:, 1:], token_b.astype(jnp.int32)[:, None]], axis=1
        )
        matched_b = jnp.zeros_like(state.fired_b)
        for pattern in self.patterns:
            suffix_bp = recent_bm[:, self.window - len(pattern) :]
            matched_b |= jnp.all(suffix_bp == jnp.asarray(pattern, jnp.int32), axis=1)
        return TokenPatternState(recent_bm=recent_bm, fired_b=state.fired_b | matched_b)


class TokenCountState(NamedTuple):
    count_b: jax.Array  # generated tokens seen per sequence
    fired_b: jax.Array  # sticky: count_b >= window_tokens


@dataclasses.dataclass(frozen=True)
class TokenCountDetector:
    """Fires once a sequence has generated ``window_tokens`` tokens (pure, jit-able).

    With the "window" schedule (edit rows whose flag is NOT set) the hook edits the forward
    passes that produce generated tokens ``1 .. window_tokens`` and none after: the flag the
    model sees while producing token ``j`` is the state after tokens ``1 .. j-1``.
    """

    window_tokens: int

    def __post_init__(self) -> None:
        if isinstance(self.window_tokens, bool) or not isinstance(self.window_tokens, int) \
                or self.window_tokens < 1:
            raise ValueError(f"window_tokens must be an int >= 1, got {self.window_tokens!r}")

    def init(self, batch_size: int) -> TokenCountState:
        return TokenCountState(count_b=jnp.zeros((batch_size,), jnp.int32),
                               fired_b=jnp.zeros((batch_size,), bool))

    def update(self, state: TokenCountState, token_b: jax.Array) -> TokenCountState:
        del token_b
        count_b = state.count_b + 1
        return TokenCountState(count_b=count_b, fired_b=state.fired_b | (count_b >= self.window_tokens))


# ---- text markers on device -----------------------------------------------------------
# The text tracker's markers in the regex subset TextMarkerDetector compiles: each is also a
# Python regex, and re.search finds it exactly where the automaton fires. They differ from
# DEFAULT_ANSWER_PATTERNS only where noted: "(?:is|:)" is split in two, the optional
# "(?:the\s+)?" of the final-answer marker is dropped (it moves a match's start, never its
# end), and "the answer is" loses its trailing "\b" (a look-ahead: the automaton cannot wait
# for the next character, so "the answer issue" fires here and not in the text tracker).
DEVICE_ANSWER_PATTERNS: tuple[str, ...] = (
    r"\\boxed\{",
    r"(?i)\bfinal\s+answer\s*is",
    r"(?i)\bfinal\s+answer\s*:",
    r"(?i)\bthe\s+answer\s+is",
    r"(?i)\*\*answer\*\*",
    r"(?im)^\s*answer\s*:",
)

_REGEX_META = set(".^$*+?()[]{}|\\")
# Character kinds (what assertions and \s atoms look at) and the previous-character context.
_START, _NEWLINE, _SPACE, _WORD, _OTHER = range(5)


@dataclasses.dataclass(frozen=True)
class _Marker:
    atoms: tuple[tuple[str, str], ...]  # ("lit", ch) | ("ws", "") | ("ws*", "")
    ignore_case: bool
    start: str  # "" | "word" (\b) | "line" (^ with (?m)) | "text" (^)


def parse_marker(pattern: str) -> _Marker:
    r"""Parses the regex subset of :class:`TextMarkerDetector`: optional ``(?i)`` / ``(?m)``
    / ``(?im)`` flags, an optional leading ``\b`` or ``^``, then literal characters
    (metacharacters escaped: ``\{``, ``\*``, ``\\``), ``\s+`` and ``\s*``."""
    rest, flags = pattern, ""
    if m := re.match(r"\(\?([im]+)\)", rest):
        flags, rest = m.group(1), rest[m.end():]
    start = ""
    if rest.startswith(r"\b"):
        start, rest = "word", rest[2:]
    elif rest.startswith("^"):
        start, rest = ("line" if "m" in flags else "text"), rest[1:]
    atoms: list[tuple[str, str]] = []
    i = 0
    while i < len(rest):
        c = rest[i]
        if rest.startswith(r"\s+", i):
            atoms += [("ws", ""), ("ws*", "")]
            i += 3
        elif rest.startswith(r"\s*", i):
            atoms.append(("ws*", ""))
            i += 3
        elif c == "\\" and i + 1 < len(rest) and rest[i + 1] in _REGEX_META:
            atoms.append(("lit", rest[i + 1]))
            i += 2
        elif c in _REGEX_META or c.isspace():
            raise ValueError(f"marker {pattern!r}: {c!r} at {i} is outside the supported subset "
                             "(literals, escaped metacharacters, \\s+, \\s*, leading \\b or ^)")
        else:
            atoms.append(("lit", c))
            i += 1
    if not any(kind == "lit" for kind, _ in atoms):
        raise ValueError(f"marker {pattern!r} has no literal character")
    if start == "word" and not re.match(r"\w", next(ch for kind, ch in atoms if kind == "lit")):
        raise ValueError(f"marker {pattern!r}: a leading \\b needs a word character after it")
    return _Marker(tuple(atoms), "i" in flags, start)


def _kind(c: str) -> int:
    if c == "\n":
        return _NEWLINE
    if re.match(r"\s", c):
        return _SPACE
    return _WORD if re.match(r"\w", c) else _OTHER


class _CharAutomaton:
    """Subset construction over the markers' character classes: ``delta[S, C]``,
    ``accept[S, C]`` (a marker completes on that character); state 0 = start of text."""

    def __init__(self, markers: list[_Marker]):
        literals = set()
        for marker in markers:
            for kind, ch in marker.atoms:
                if kind == "lit":
                    literals |= {ch, ch.lower(), ch.upper()} if marker.ignore_case else {ch}
        # Classes: one per literal character, then one per kind of any other character.
        self.literals = sorted(literals)
        self.class_of_literal = {ch: i for i, ch in enumerate(self.literals)}
        generic = {k: len(self.literals) + i for i, k in enumerate((_NEWLINE, _SPACE, _WORD, _OTHER))}
        self.generic = generic
        self._cache: dict[str, int] = {}
        class_kind = [_kind(ch) for ch in self.literals] + [_NEWLINE, _SPACE, _WORD, _OTHER]
        class_char = self.literals + [None] * 4

        def closure(items):
            out, todo = set(), list(items)
            while todo:
                m, pos = todo.pop()
                if (m, pos) in out:
                    continue
                out.add((m, pos))
                atoms = markers[m].atoms
                if pos < len(atoms) and atoms[pos][0] == "ws*":
                    todo.append((m, pos + 1))
            return out

        def starts(prev: int):
            ok = {"": True, "word": prev != _WORD, "line": prev in (_START, _NEWLINE),
                  "text": prev == _START}
            return closure((m, 0) for m, marker in enumerate(markers) if ok[marker.start])

        def step(key, cls):
            items, prev = key
            kind, ch = class_kind[cls], class_char[cls]
            nxt = set()
            for m, pos in items | starts(prev):
                marker = markers[m]
                if pos == len(marker.atoms):
                    continue
                atom, lit = marker.atoms[pos]
                if atom == "lit":
                    hit = ch is not None and (ch == lit or (marker.ignore_case
                                                            and ch.lower() == lit.lower()))
                    if hit:
                        nxt |= closure([(m, pos + 1)])
                elif kind in (_NEWLINE, _SPACE):
                    nxt |= closure([(m, pos + 1)] if atom == "ws" else [(m, pos)])
            accepted = any(pos == len(markers[m].atoms) for m, pos in nxt)
            nxt = frozenset((m, pos) for m, pos in nxt if pos < len(markers[m].atoms))
            return (nxt, kind), accepted

        num_classes = len(class_kind)
        keys = [(frozenset(), _START)]
        index = {keys[0]: 0}
        delta, accept = [], []
        while len(delta) < len(keys):
            key = keys[len(delta)]
            row, row_accept = [], []
            for cls in range(num_classes):
                nxt, accepted = step(key, cls)
                if nxt not in index:
                    index[nxt] = len(keys)
                    keys.append(nxt)
                row.append(index[nxt])
                row_accept.append(accepted)
            delta.append(row)
            accept.append(row_accept)
        self.delta = np.asarray(delta, np.int32)
        self.accept = np.asarray(accept, bool)

    def classes(self, text: str) -> tuple[int, ...]:
        cache = self._cache
        out = []
        for c in text:
            cls = cache.get(c)
            if cls is None:
                cls = cache[c] = self.class_of_literal.get(c, self.generic[_kind(c)])
            out.append(cls)
        return tuple(out)


class TextMarkerState(NamedTuple):
    dfa_b: jax.Array  # automaton state per sequence (int32)
    fired_b: jax.Array  # sticky bool flag per sequence


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity (a jit static argument)
class TextMarkerDetector:
    r"""Fires at the generated token whose text completes a text marker (pure, jit-able).

    A character automaton over the markers (:func:`parse_marker`'s regex subset; matched in
    the decoded text of the generated tokens, ``^`` / ``\b`` seeing the start of the
    generation as the start of the text) is run over every token's text once on the host:
    ``trans[s, c]`` / ``hit[s, c]`` give the state after a token of class ``c`` and whether
    a marker completed inside it, ``token_class[v]`` the class of token ``v`` (tokens with
    the same transitions share one). On device an update is two gathers. Unlike
    :class:`TokenPatternDetector` it does not depend on how the marker was tokenised.

    Build it with :meth:`from_token_texts` (or :meth:`from_tokenizer`). Ids outside the
    table read as empty text (no transition).
    """

    token_class: np.ndarray  # [V] int32
    trans: np.ndarray  # [S, K] int32
    hit: np.ndarray  # [S, K] bool
    patterns: tuple[str, ...] = DEVICE_ANSWER_PATTERNS

    @classmethod
    def from_token_texts(cls, token_texts: list[str],
                         patterns: tuple[str, ...] = DEVICE_ANSWER_PATTERNS) -> TextMarkerDetector:
        if not patterns:
            raise ValueError("patterns must not be empty")
        automaton = _CharAutomaton([parse_marker(p) for p in patterns])
        # Unique class sequences, run through the automaton from every state at once;
        # longest first, so position p only touches the prefix of sequences longer than p.
        seqs: dict[tuple[int, ...], int] = {(): 0}
        token_seq = np.empty(len(token_texts), np.int64)
        for v, text in enumerate(token_texts):
            token_seq[v] = seqs.setdefault(automaton.classes(text), len(seqs))
        order = sorted(seqs, key=len, reverse=True)
        lengths = np.array([len(q) for q in order])
        padded = np.zeros((len(order), max(lengths.max(), 1)), np.int64)
        for i, q in enumerate(order):
            padded[i, : len(q)] = q
        num_states = automaton.delta.shape[0]
        state = np.broadcast_to(np.arange(num_states)[:, None], (num_states, len(order))).copy()
        hit = np.zeros(state.shape, bool)
        for pos in range(padded.shape[1]):
            n = int((lengths > pos).sum())
            cls_u = padded[:n, pos]
            hit[:, :n] |= automaton.accept[state[:, :n], cls_u]
            state[:, :n] = automaton.delta[state[:, :n], cls_u]
        rank = np.empty(len(order), np.int64)
        rank[[seqs[q] for q in order]] = np.arange(len(order))
        # Merge sequences with identical columns (same next state and hit from every state).
        rows = np.ascontiguousarray(
            np.concatenate([state, hit.astype(state.dtype)], axis=0).T.astype(np.int32))
        column_of: dict[bytes, int] = {}
        inverse = np.array([column_of.setdefault(row.tobytes(), len(column_of)) for row in rows])
        first = np.zeros(len(column_of), np.int64)
        first[inverse[::-1]] = np.arange(len(inverse))[::-1]
        token_class = inverse[rank[token_seq]].astype(np.int32)
        return cls(token_class, state[:, first].astype(np.int32), hit[:, first], tuple(patterns))

    @classmethod
    def from_tokenizer(cls, tokenizer, patterns: tuple[str, ...] = DEVICE_ANSWER_PATTERNS,
                       vocab_size: int | None = None) -> TextMarkerDetector:
        """Token texts from ``tokenizer.decode([v], skip_special_tokens=True)`` (special
        tokens are empty text, as in the decoded completion the text tracker reads)."""
        size = vocab_size or tokenizer.vocab_size
        texts = [tokenizer.decode([v], skip_special_tokens=True) for v in range(size)]
        return cls.from_token_texts(texts, patterns)

    def init(self, batch_size: int) -> TextMarkerState:
        return TextMarkerState(dfa_b=jnp.zeros((batch_size,), jnp.int32),
                               fired_b=jnp.zeros((batch_size,), bool))

    def update(self, state: TextMarkerState, token_b: jax.Array) -> TextMarkerState:
        # An extra identity column for ids outside the table.
        num_states = self.trans.shape[0]
        trans = np.concatenate([self.trans, np.arange(num_states, dtype=np.int32)[:, None]], 1)
        hit = np.concatenate([self.hit, np.zeros((num_states, 1), bool)], 1)
        cls_b = jnp.take(jnp.asarray(self.token_class), token_b.astype(jnp.int32), mode="fill",
                         fill_value=trans.shape[1] - 1)
        hit_b = jnp.asarray(hit)[state.dfa_b, cls_b]
        return TextMarkerState(dfa_b=jnp.asarray(trans)[state.dfa_b, cls_b],
                               fired_b=state.fired_b | hit_b)

    def first_fire(self, token_ids) -> int | None:
        """Host-side reference: index of the first token at which the detector fires."""
        dfa = 0
        for i, t in enumerate(token_ids):
            c = self.token_class[t] if 0 <= t < len(self.token_class) else None
            if c is None:
                continue
            if self.hit[dfa, c]:
                return i
            dfa = int(self.trans[dfa, c])
        return None


def detector_for_schedule(schedule: str, *, first_answer=None, window_tokens: int | None = None):
    """The device detector a steering schedule needs, or None for "always".

    ``first_answer``: the first-answer detector ("after_first_answer", "before_first_answer");
    ``window_tokens``: W of the "window" schedule. Raises ValueError when the schedule is
    unknown, a needed one is missing (or W < 1), or one is given that the schedule ignores.
    """
    from spade_jax.steering.operator import SCHEDULES

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "window":
        if window_tokens is None:
            raise ValueError("schedule='window' needs a window length (window_tokens >= 1)")
        return TokenCountDetector(window_tokens)
    if window_tokens is not None:
        raise ValueError(f"window_tokens is only for schedule='window', not {schedule!r}")
    if schedule == "always":
        return None
    if first_answer is None:
        raise ValueError(f"schedule={schedule!r} needs a first-answer detector")
    return first_answer
