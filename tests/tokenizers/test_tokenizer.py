"""Tokenizer backends against independent references.

* HF backend vs ``transformers.AutoTokenizer`` on a byte-level BPE ``tokenizer.json`` this file
  trains itself (Qwen2/3 layout: NFC, Qwen split regex, ByteLevel, chat added tokens), for
  plain text and for chat-templated conversations (rendered string and ids).
* The built-in Qwen3 chat template vs a plain-Python re-derivation of Qwen3's format and
  hand-written expected prompts.
* Sentencepiece backend: lossless round trip, chat tokens as single ids, the same rendered
  chat as the HF backend.
"""

import json
import random
import time
import unicodedata

import pytest
from tokenizers import (
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as RustTokenizer

from spade_jax.tokenizers import (
    QWEN3_CHAT_TEMPLATE,
    ChatTemplate,
    HFTokenizer,
    SentencePieceTokenizer,
    SentencePieceTrainConfig,
    Tokenizer,
    load_tokenizer,
    project_text_files,
    train_sentencepiece,
)

transformers = pytest.importorskip("transformers")

QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3's added tokens that matter here, with its special flags (think tags are not special).
ADDED_TOKENS = {"<|endoftext|>": True, "<|im_start|>": True, "<|im_end|>": True,
                "<think>": False, "</think>": False, "<tool_response>": False,
                "</tool_response>": False}

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog. It's what we'll do, isn't it?\n",
    "def reset(self, seed=None):\n    self.state = 0\n    return self.state, {}\n\n",
    "def step(self, action):\n        reward = 1.0 if action == self.target else 0.0\n",
    "Größe, café, naïve, Ångström — «quotes» and “smart quotes”.\n",
    "你好，世界！机器学习和强化学习。こんにちは世界。안녕하세요.\n",
    "مرحبا بالعالم. Привет, мир! Γειά σου κόσμε.\n",
    "Emoji: 🎉🚀👍🏽 👨‍👩‍👧‍👦 ❤️ numbers 0123456789 3.14159 1e-5\n",
    "\t\tTabs\tand   spaces\r\nwindows line\r\n",
]

PLAIN_TEXTS = [
    "",
    "hello world",
    "Hello, World! It's 2024; we'll see.",
    "e\u0301 vs \u00e9 — NFC makes these equal; café naïve",
    "你好，世界！强化学习的环境 こんにちは 안녕",
    "🎉 👨‍👩‍👧‍👦 👍🏽 🇺🇸 ❤️‍🔥",
    "    \n\n\n\t\t  trailing   \r\n  ",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n<think>\nreason\n</think>\n\n<|endoftext|>",
    "text<|im_end|>glued<think>on</think>both sides",
    "numbers 1234567890 and 3.14e-10, x=-42",
    "\u2581 sentencepiece's space mark, \x00 nul, \x7f del, \u200b zero width",
]

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is 2 + 2?"}],
    "system_user": [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "Write a haiku about JAX."},
    ],
    "history_with_think": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "First question?"},
        {"role": "assistant", "content": "<think>\nsome reasoning\n</think>\n\nFirst answer."},
        {"role": "user", "content": "Second question?"},
    ],
    "last_assistant_with_think": [
        {"role": "user", "content": "Solve x + 1 = 3."},
        {"role": "assistant", "content": "<think>subtract one</think>x = 2"},
    ],
    "assistant_without_think_after_query": [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "hi"},
    ],
    "reasoning_content_field": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning_content": "\nthought\n"},
    ],
    "multi_turn": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "<think>r1</think>a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "<think>\n\nr2\n\n</think>\n\n\na2"},
        {"role": "assistant", "content": "a3 without reasoning"},
        {"role": "assistant", "content": "<think>r4</think>a4"},
    ],
    "tool_responses": [
        {"role": "user", "content": "Run the environment."},
        {"role": "assistant", "content": "<think>call it</think>calling"},
        {"role": "tool", "content": "obs: 1"},
        {"role": "tool", "content": "obs: 2"},
        {"role": "assistant", "content": "<think>done</think>Finished."},
    ],
    "system_in_the_middle": [
        {"role": "user", "content": "u"},
        {"role": "system", "content": "late system"},
        {"role": "user", "content": "v"},
    ],
    "non_ascii": [
        {"role": "system", "content": "Réponds en français. 日本語もOK。"},
        {"role": "user", "content": "Ça va? 🎉 \u00e9 vs e\u0301"},
        {"role": "assistant", "content": "<think>\n思考中…\n</think>\n\nTrès bien! 👍"},
        {"role": "user", "content": "Et toi?   \n\n"},
    ],
}
FLAG_COMBINATIONS = [(g, e) for g in (False, True) for e in (True, False)]


def _random_texts(count: int, seed: int) -> list[str]:
    """Random strings over ASCII, whitespace, Latin, combining marks, CJK, emoji, chat tokens."""
    rng = random.Random(seed)
    alphabets = [
        [chr(c) for c in range(32, 127)],
        list(" \t\n\r\u00a0\u3000\u2581"),
        [chr(c) for c in range(0xC0, 0x17F)],
        [chr(c) for c in range(0x300, 0x36F)],
        [chr(c) for c in range(0x4E00, 0x4E80)],
        [chr(c) for c in range(0x1F600, 0x1F64F)] + ["\u200d", "\ufe0f"],
        list(ADDED_TOKENS),
    ]
    return ["".join(rng.choice(rng.choice(alphabets)) for _ in range(rng.randint(1, 60)))
            for _ in range(count)]


def _qwen3_reference_render(messages, add_generation_prompt, enable_thinking,
                            tools=None) -> str:
    """Qwen3's chat format re-derived in plain Python (no Jinja)."""
    messages = [dict(m, content=m.get("content") or "") for m in messages]
    n = len(messages)
    last_query = n - 1
    for i in reversed(range(n)):
        content = messages[i]["content"]
        is_tool_wrapped = content.startswith("<tool_response>") and content.endswith("</tool_response>")
        if messages[i]["role"] == "user" and not is_tool_wrapped:
            last_query = i
            break
    parts = []
    if tools:
        system = messages[0]["content"] if messages[0]["role"] == "system" else None
        parts.append(_qwen3_reference_tools(tools, system))
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if tools and i == 0 and role == "system":
            continue  # inside the tools turn
        if role in ("system", "user"):  # a leading system turn renders like any other
            parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        elif role == "assistant":
            reasoning = message.get("reasoning_content")
            if reasoning is None:
                reasoning = ""
                if "</think>" in content:
                    before_close = content.split("</think>")[0]
                    reasoning = before_close.rstrip("\n").split("<think>")[-1].lstrip("\n")
                    content = content.split("</think>")[-1].lstrip("\n")
            if i > last_query and (i == n - 1 or reasoning):
                body = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"
            else:
                body = content
            body += _reference_tool_calls(content, message.get("tool_calls") or [])
            parts.append(f"<|im_start|>assistant\n{body}<|im_end|>\n")
        elif role == "tool":
            opens = i == 0 or messages[i - 1]["role"] != "tool"
            closes = i == n - 1 or messages[i + 1]["role"] != "tool"
            parts.append(("<|im_start|>user" if opens else "")
                         + f"\n<tool_response>\n{content}\n</tool_response>"
                         + ("<|im_end|>\n" if closes else ""))
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
        if not enable_thinking:
            parts.append("<think>\n\n</think>\n\n")
    return "".join(parts)


# Tool definitions in the function format (one nested, one bare), and conversations with
# tool calls: several calls in one turn, string and dict arguments, tool responses, a
# system prompt with tools, reasoning before a call.
TOOLS = [
    {"type": "function", "function": {
        "name": "move", "description": "Move the robot one cell.",
        "parameters": {"type": "object", "properties": {
            "direction": {"type": "string", "enum": ["north", "south", "east", "west"]}},
            "required": ["direction"]}}},
    {"name": "look", "description": "Describe the cell. Größe → ünïcödé",
     "parameters": {"type": "object", "properties": {}}},
]
TOOL_CONVERSATIONS = {
    "tools_user_only": [{"role": "user", "content": "Where am I?"}],
    "tools_with_system": [{"role": "system", "content": "You control a robot."},
                          {"role": "user", "content": "Go north twice, then look."}],
    "several_calls_then_responses": [
        {"role": "system", "content": "You control a robot."},
        {"role": "user", "content": "Go north twice, then look."},
        {"role": "assistant", "content": "<think>two moves</think>Moving.", "tool_calls": [
            {"type": "function", "function": {"name": "move", "arguments": {"direction": "north"}}},
            {"type": "function", "function": {"name": "move",
                                              "arguments": '{"direction": "north"}'}}]},
        {"role": "tool", "content": "moved to (0, 1)"},
        {"role": "tool", "content": "moved to (0, 2)"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"name": "look", "arguments": {}}]},
        {"role": "tool", "content": "a red door"},
    ],
    "call_without_content": [
        {"role": "user", "content": "Look around."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "look", "arguments": {}}}]},
        {"role": "tool", "content": "grass"},
        {"role": "assistant", "content": "<think>done</think>It is grass."},
    ],
}


def _qwen3_reference_tools(tools, system: str | None) -> str:
    """The built-in template's tools system turn, re-derived in plain Python."""
    head = f"{system}\n\n" if system is not None else ""
    schemas = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return ("<|im_start|>system\n" + head + "# Tools\n\nYou can call the functions described "
            "below. Their signatures are JSON schemas inside <tools></tools> tags:\n<tools>"
            + schemas + "\n</tools>\n\nTo call a function, write one JSON object with its "
            "name and arguments inside <tool_call></tool_call> tags; use one block per call:"
            "\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <arguments-object>}"
            "\n</tool_call><|im_end|>\n")


def _reference_tool_calls(content: str, calls) -> str:
    parts = []
    for k, call in enumerate(calls):
        call = call.get("function", call)
        args = call["arguments"]
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        parts.append(("\n" if k or content else "")
                     + f'<tool_call>\n{{"name": "{call["name"]}", "arguments": {args}}}'
                     + "\n</tool_call>")
    return "".join(parts)


def _build_byte_level_bpe(corpus: list[str]) -> RustTokenizer:
    """A small tokenizer with Qwen2/3's tokenizer.json layout."""
    tokenizer = RustTokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=1200, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    for token, special in ADDED_TOKENS.items():
        added = AddedToken(token, special=special, normalized=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([added])
    return tokenizer


def _write_hf_dir(directory, tokenizer: RustTokenizer, tokenizer_class: str, chat_template):
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": tokenizer_class,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(token)): {
                "content": token, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": special}
            for token, special in ADDED_TOKENS.items()},
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "add_prefix_space": False, "clean_up_tokenization_spaces": False,
        "errors": "replace", "model_max_length": 131072, "split_special_tokens": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def bpe_backend() -> RustTokenizer:
    return _build_byte_level_bpe(TRAINING_TEXT * 4 + _random_texts(50, seed=1))


@pytest.fixture(scope="module", params=["Qwen2Tokenizer", "PreTrainedTokenizerFast"])
def hf_pair(request, bpe_backend, tmp_path_factory):
    """(our HFTokenizer, transformers' AutoTokenizer) loaded from the same directory."""
    directory = _write_hf_dir(tmp_path_factory.mktemp("hf"), bpe_backend, request.param,
                              QWEN3_CHAT_TEMPLATE)
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    return load_tokenizer(directory), reference


@pytest.fixture(scope="module")
def sp_tokenizer(tmp_path_factory) -> tuple[SentencePieceTokenizer, float]:
    start = time.perf_counter()
    tok = train_sentencepiece(project_text_files() + TRAINING_TEXT,
                              tmp_path_factory.mktemp("spm") / "spade", vocab_size=2000)
    return tok, time.perf_counter() - start


# --- HF backend vs transformers ----------------------------------------------------------------


def test_plain_text_ids_and_decoding_match_transformers(hf_pair):
    ours, reference = hf_pair
    assert isinstance(ours, HFTokenizer) and isinstance(ours, Tokenizer)
    for text in PLAIN_TEXTS + _random_texts(150, seed=2):
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ids == reference(text, add_special_tokens=False)["input_ids"], text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip), text
        # Byte-level BPE is lossless up to the NFC normalizer.
        assert ours.decode(ids) == unicodedata.normalize("NFC", text)
    assert ours.vocab_size == len(reference)


def test_chat_template_matches_transformers(hf_pair):
    ours, reference = hf_pair
    for name, messages in CONVERSATIONS.items():
        for add_generation_prompt, enable_thinking in FLAG_COMBINATIONS:
            flags = dict(add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
            expected_text = reference.apply_chat_template(messages, tokenize=False, **flags)
            expected_ids = reference.apply_chat_template(messages, tokenize=True,
                                                         return_dict=False, **flags)
            assert ours.render_chat(messages, **flags) == expected_text, (name, flags)
            assert ours.apply_chat_template(messages, **flags) == expected_ids, (name, flags)


def test_tool_rendering_matches_transformers(hf_pair):
    """Issue 32: tools and tool calls render as transformers renders the same template
    (several calls in one turn, string and dict arguments, tool responses, a system prompt
    with tools, thinking on and off, a call with no content)."""
    ours, reference = hf_pair
    for name, messages in {**TOOL_CONVERSATIONS, **CONVERSATIONS}.items():
        for add_generation_prompt, enable_thinking in FLAG_COMBINATIONS:
            flags = dict(add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
            expected = reference.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                                     **flags)
            assert ours.render_chat(messages, tools=TOOLS, **flags) == expected, (name, flags)
            assert ours.apply_chat_template(messages, tools=TOOLS, **flags) == (
                reference.apply_chat_template(messages, tools=TOOLS, return_dict=False,
                                              **flags)), (name, flags)
        if name in TOOL_CONVERSATIONS:  # without tools: calls still render, no tools turn
            assert ours.render_chat(messages) == reference.apply_chat_template(
                messages, tokenize=False), name


def test_builtin_template_renders_tools_as_the_python_reference():
    template = ChatTemplate()
    for name, messages in TOOL_CONVERSATIONS.items():
        for add_generation_prompt, enable_thinking in FLAG_COMBINATIONS:
            for tools in (TOOLS, None):
                assert template.render(messages, add_generation_prompt, enable_thinking,
                                       tools=tools) == _qwen3_reference_render(
                    messages, add_generation_prompt, enable_thinking, tools), name
    text = template.render(TOOL_CONVERSATIONS["several_calls_then_responses"], tools=TOOLS)
    assert text.count("<tool_call>") == 5  # three calls, and two in the tools turn's text
    assert '{"name": "move", "arguments": {"direction": "north"}}' in text


@pytest.mark.parametrize("messages, tools, error, match", [
    ([{"role": "user", "content": "x"}], {"name": "f"}, TypeError, "list"),
    ([{"role": "user", "content": "x"}], [{"description": "no name"}], ValueError, "name"),
    ([{"role": "user", "content": "x"}], [{"name": "f", "x": object()}], ValueError, "JSON"),
    ([{"role": "user", "content": "x", "tool_calls": []}], None, ValueError, "assistant"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"arguments": {}}]}], None,
     ValueError, "name"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": 3}]}],
     None, ValueError, "arguments"),
    ([{"role": "assistant", "content": None}], None, ValueError, "content"),
])
def test_bad_tools_and_tool_calls_are_named(messages, tools, error, match):
    with pytest.raises(error, match=match):
        ChatTemplate().render(messages, tools=tools)


def test_special_ids_match_transformers(hf_pair):
    ours, reference = hf_pair
    assert ours.eos_ids == {reference.convert_tokens_to_ids("<|im_end|>"),
                            reference.convert_tokens_to_ids("<|endoftext|>")}
    assert ours.pad_id == reference.pad_token_id
    for token in ADDED_TOKENS:
        assert ours.encode(token) == [reference.convert_tokens_to_ids(token)]


def test_directory_chat_template_file_wins(bpe_backend, tmp_path):
    # A different (ChatML-like) template that also reads eos_token: chat_template.jinja must
    # take precedence over tokenizer_config.json, as in transformers.
    directory = _write_hf_dir(tmp_path / "custom", bpe_backend, "Qwen2Tokenizer", QWEN3_CHAT_TEMPLATE)
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
        "{% generation %}{{ m.content | trim }}{{ eos_token }}{% endgeneration %}{% else %}"
        "{{ m.content | trim }}{{ eos_token }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        encoding="utf-8")
    ours = load_tokenizer(directory)
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    messages = CONVERSATIONS["history_with_think"]
    rendered = ours.render_chat(messages, add_generation_prompt=True)
    assert "<think>" in rendered  # the Qwen3 template would have dropped this history reasoning
    assert rendered == reference.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=True)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == (
        reference.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


def test_directory_without_template_uses_builtin_qwen3(bpe_backend, tmp_path):
    ours = load_tokenizer(_write_hf_dir(tmp_path / "plain", bpe_backend, "Qwen2Tokenizer", None))
    messages = CONVERSATIONS["multi_turn"]
    assert ours.render_chat(messages, True, False) == _qwen3_reference_render(messages, True, False)


# --- built-in Qwen3 template vs a plain-Python re-derivation --------------------------------


def test_builtin_template_matches_python_reference_of_qwen3():
    template = ChatTemplate()
    for name, messages in CONVERSATIONS.items():
        for add_generation_prompt, enable_thinking in FLAG_COMBINATIONS:
            assert template.render(messages, add_generation_prompt, enable_thinking) == (
                _qwen3_reference_render(messages, add_generation_prompt, enable_thinking)), name


def test_builtin_template_hand_written_prompts():
    template = ChatTemplate()
    assert template.render(CONVERSATIONS["system_user"], add_generation_prompt=True,
                           enable_thinking=False) == (
        "<|im_start|>system\nYou are a careful assistant.<|im_end|>\n"
        "<|im_start|>user\nWrite a haiku about JAX.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert template.render(CONVERSATIONS["history_with_think"], add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nFirst question?<|im_end|>\n"
        "<|im_start|>assistant\nFirst answer.<|im_end|>\n"
        "<|im_start|>user\nSecond question?<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert template.render(CONVERSATIONS["last_assistant_with_think"]) == (
        "<|im_start|>user\nSolve x + 1 = 3.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nsubtract one\n</think>\n\nx = 2<|im_end|>\n")


@pytest.mark.parametrize("messages, error", [
    ([], ValueError),
    ("hello", TypeError),
    ([{"role": "user"}], ValueError),
    ([{"role": "robot", "content": "x"}], ValueError),
    ([{"role": "user", "content": ["list"]}], ValueError),
    (["not a dict"], TypeError),
])
def test_bad_messages_are_rejected(messages, error):
    with pytest.raises(error):
        ChatTemplate().render(messages)


def test_bad_template_and_flags_are_rejected():
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(TypeError, match="enable_thinking"):
        ChatTemplate().render(CONVERSATIONS["user_only"], enable_thinking="no")


# --- sentencepiece backend -----------------------------------------------------------------------


def test_sentencepiece_trains_quickly_on_project_text(sp_tokenizer):
    tok, seconds = sp_tokenizer
    assert isinstance(tok, Tokenizer)
    assert seconds < 10.0
    assert 1000 < tok.vocab_size <= 2000
    corpus = {path.name for path in project_text_files()}
    assert {"sharding.py", "test_tokenizer.py"} <= corpus  # whole package and tests, not one folder
    # Trained on code, so common code fragments take fewer ids than characters.
    code = "def step(self, action):\n        return self.state"
    assert len(tok.encode(code)) < len(code) / 2


def test_sentencepiece_round_trips_any_text(sp_tokenizer):
    tok, _ = sp_tokenizer
    for text in PLAIN_TEXTS + _random_texts(300, seed=3) + ["  lead", "trail  ", "\u2581\u2581x\u2581"]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text, repr(text)


def test_sentencepiece_chat_tokens_are_single_ids(sp_tokenizer):
    tok, _ = sp_tokenizer
    ids = {token: tok.encode(token) for token in list(ADDED_TOKENS)[:5]}
    assert all(len(v) == 1 for v in ids.values()), ids
    assert len({v[0] for v in ids.values()}) == 5
    assert tok.eos_ids == {ids["<|im_end|>"][0], ids["<|endoftext|>"][0]}
    assert tok.pad_id == ids["<|endoftext|>"][0]
    assert tok.encode("a<|im_end|>b")[1:-1] == ids["<|im_end|>"]


def test_sentencepiece_chat_equals_hf_backend(sp_tokenizer, hf_pair):
    sp_tok, _ = sp_tokenizer
    hf_tok, _ = hf_pair
    for name, messages in CONVERSATIONS.items():
        for add_generation_prompt, enable_thinking in FLAG_COMBINATIONS:
            rendered = sp_tok.render_chat(messages, add_generation_prompt, enable_thinking)
            assert rendered == hf_tok.render_chat(messages, add_generation_prompt, enable_thinking)
            ids = sp_tok.apply_chat_template(messages, add_generation_prompt, enable_thinking)
            assert sp_tok.decode(ids) == rendered, name
            (im_start,) = sp_tok.encode("<|im_start|>")
            assert ids.count(im_start) == rendered.count("<|im_start|>")
            # Dropping special tokens keeps the think tags, in both backends (HF applies NFC).
            assert unicodedata.normalize("NFC", sp_tok.decode(ids, skip_special_tokens=True)) == (
                hf_tok.decode(hf_tok.encode(rendered), skip_special_tokens=True)), name


def test_load_tokenizer_picks_sentencepiece(sp_tokenizer, tmp_path):
    tok, _ = sp_tokenizer
    directory = tmp_path / "spdir"
    directory.mkdir()
    (directory / "tokenizer.model").write_bytes(tok.model_file.read_bytes())
    loaded = load_tokenizer(directory)
    assert isinstance(loaded, SentencePieceTokenizer)
    assert loaded.encode("héllo <|im_start|>") == tok.encode("héllo <|im_start|>")
    assert isinstance(load_tokenizer(directory / "tokenizer.model"), SentencePieceTokenizer)


def test_hf_config_errors_name_the_problem(bpe_backend, tmp_path):
    directory = _write_hf_dir(tmp_path / "named", bpe_backend, "Qwen2Tokenizer",
                              [{"name": "tool_use", "template": "{{ messages }}"}])
    with pytest.raises(ValueError, match="no 'default' entry"):
        load_tokenizer(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(chat_template=None, eos_token="<|not_a_token|>")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="eos_token '<\\|not_a_token\\|>'"):
        load_tokenizer(directory / "tokenizer.json")


def test_load_errors_are_clear(tmp_path, sp_tokenizer):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="need tokenizer.json"):
        load_tokenizer(tmp_path)
    tok, _ = sp_tokenizer
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TypeError, match="expects a str"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="vocab_size"):
        SentencePieceTrainConfig(vocab_size=100)
    with pytest.raises(ValueError, match="missing"):
        SentencePieceTrainConfig(user_defined_symbols=("<|im_end|>",))
    with pytest.raises(ValueError, match="empty"):
        train_sentencepiece(["", "\n"], tmp_path / "empty")
