"""Tokenizer operations every backend offers (encode, decode, per-token texts, chat rendering, EOS ids).

One implementation for both ends: the in-process `Engine` wraps its model's tokenizer in a
`TokenizerOps`, and `RemoteBackend` builds the same `TokenizerOps` from the tokenizer files the
model server hands out once (`GET /tokenizer`), so encoding never costs a round trip and the
checks (empty prompt, over-long prompt, context length) are the same on both sides.

Example:
    >>> from probes.zoo import load_model
    >>> ops = TokenizerOps.of(load_model("tiny-random:llama"))
    >>> ids = ops.encode("2 + 2 =")
    >>> ops.decode(ids) == "2 + 2 =", "".join(ops.token_texts(ids)) == "2 + 2 ="
    (True, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from thoughtscope.errors import BadInputError

Prompt = str | list[dict[str, str]] | list[int]
MAX_PROMPT_CHARS = 200_000


class TokenizerOps:
    """Encode/decode with the checks every prompt goes through, over one Hugging Face tokenizer."""

    def __init__(self, tokenizer: Any, context_length: int, vocab_size: int, eos_ids: Sequence[int]):
        self.tok = tokenizer
        self.context_length = int(context_length)
        self.vocab_size = int(vocab_size)
        self._eos = sorted({int(i) for i in eos_ids})

    @classmethod
    def of(cls, handle: Any) -> "TokenizerOps":
        """The operations of a loaded model (EOS ids from its generation config and its tokenizer)."""
        tok = handle.tokenizer
        eos = getattr(getattr(handle.model, "generation_config", None), "eos_token_id", None)
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tok.eos_token_id is not None:
            ids.add(tok.eos_token_id)
        return cls(tok, handle.arch.context_length, handle.arch.vocab_size, ids)

    # ----- what a backend exposes -----

    def eos_ids(self) -> list[int]:
        return list(self._eos)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Chat messages -> prompt text through the model's template (a plain join when it has none)."""
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            raise BadInputError("chat messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        total = sum(len(m["content"]) for m in messages)
        if total > MAX_PROMPT_CHARS:
            raise BadInputError(f"the chat messages hold {total} characters; the limit is {MAX_PROMPT_CHARS}")
        for m in messages:
            _check_text(m["content"], "a chat message")
        if self.has_chat_template:
            return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return "\n".join(f"{m.get('role', 'user')}: {m['content']}" for m in messages) + "\nassistant:"

    def encode(self, prompt: Prompt, chat: bool = False, add_special_tokens: bool = True) -> list[int]:
        """Prompt -> token ids. A string is raw text unless `chat`; a list of dicts is chat messages;
        a list of ints is token ids (checked against the vocabulary)."""
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise BadInputError(f"token ids {bad[:5]} are outside this model's vocabulary 0..{self.vocab_size - 1}")
        elif isinstance(prompt, list) and not prompt:  # an empty token list, or no chat messages
            raise BadInputError("the prompt is empty: an empty list holds neither token ids nor chat messages")
        elif isinstance(prompt, list):
            ids = self.tok(self.render_chat(prompt), add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, str):
            if not prompt.strip():
                raise BadInputError("the prompt is empty; type a question or pick an example")
            if len(prompt) > MAX_PROMPT_CHARS:
                raise BadInputError(f"the prompt has {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
            _check_text(prompt, "the prompt")
            if chat:
                ids = self.tok(self.render_chat([{"role": "user", "content": prompt}]), add_special_tokens=False)["input_ids"]
            else:
                ids = self.tok(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        else:
            raise BadInputError(f"a prompt is text, chat messages or token ids, not {type(prompt).__name__}")
        if not ids:
            raise BadInputError("the prompt encodes to no tokens")
        if len(ids) >= self.context_length:
            raise BadInputError(f"the prompt has {len(ids)} tokens; this model's context is {self.context_length}: "
                                "shorten it")
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Per-token texts that concatenate to `decode(ids)` (multi-byte characters stay whole)."""
        out, before = [], ""
        for i in range(len(ids)):
            now = self.tok.decode(list(ids[: i + 1]))
            out.append(now[len(before):] if now.startswith(before) else self.tok.decode([ids[i]]))
            before = now
        return out

    def piece(self, ids: Sequence[int], new_id: int) -> str:
        """The text `new_id` adds after `ids`; decoding a short window keeps multi-byte characters whole."""
        window = list(ids[-6:])
        before = self.tok.decode(window, skip_special_tokens=False)
        after = self.tok.decode(window + [new_id], skip_special_tokens=False)
        return after[len(before):] if after.startswith(before) else self.tok.decode([new_id])


def _check_text(text: str, what: str) -> None:
    """Lone surrogates (from a JSON '\\ud800') cannot be tokenised; say so instead of failing deep inside."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BadInputError(f"{what} holds a character that is not valid Unicode text "
                            f"(a lone surrogate at position {err.start}); remove it") from err


def tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    """The files `save_pretrained` writes for a tokenizer, for shipping it to a client."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


def tokenizer_from_files(files: dict[str, bytes]) -> Any:
    """A tokenizer rebuilt from `tokenizer_files` output (never runs code: no trust_remote_code)."""
    import tempfile
    from pathlib import Path

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            if "/" in name or "\\" in name or name.startswith("."):
                raise BadInputError(f"unexpected tokenizer file name {name!r} from the server")
            (Path(tmp) / name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp, local_files_only=True, trust_remote_code=False)
