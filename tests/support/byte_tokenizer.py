"""A chat tokenizer without a model: one token per character, for tests of the SPADE loop
that inject a scripted sampler (tests/spade/test_loop.py, test_tool_track.py)."""


class ByteTokenizer:
    """Characters as token ids: enough for the loop's prompt and decode calls."""

    eos_ids = frozenset({0})
    pad_id = 0

    def apply_chat_template(self, messages, add_generation_prompt=False, enable_thinking=True):
        return [ord(c) + 1 for c in "".join(f"<{m['role']}>{m['content']}" for m in messages)]

    def encode(self, text):
        return [ord(c) + 1 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i - 1) for i in ids if i > 0)
