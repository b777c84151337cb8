"""Tokenizer loading from a checkpoint directory: tokenizer.json via `tokenizers`, else AutoTokenizer; and the
checkpoint's chat template (chat_template.jinja, or tokenizer_config.json's "chat_template")."""

from __future__ import annotations

import json
from pathlib import Path


class Tokenizer:
    """encode(text) -> ids; decode(ids) -> text; chat_template: a Jinja template of `messages`, or None."""

    def __init__(self, encode, decode, eos_token_ids: tuple[int, ...] = (), chat_template: str | None = None):
        self.encode, self.decode, self.eos_token_ids = encode, decode, eos_token_ids
        self.chat_template = chat_template


def load_chat_template(path: str | Path) -> str | None:
    path = Path(path)
    if (path / "chat_template.jinja").exists():
        return (path / "chat_template.jinja").read_text()
    if (path / "tokenizer_config.json").exists():
        template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships none (token-id prompts still work)."""
    path = Path(path)
    template = load_chat_template(path)
    if (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        return Tokenizer(lambda s: tok.encode(s).ids, lambda ids: tok.decode(list(ids), skip_special_tokens=True),
                         chat_template=template)
    if (path / "tokenizer_config.json").exists():
        try:
            from transformers import AutoTokenizer
        except ImportError:
            return None
        tok = AutoTokenizer.from_pretrained(str(path))
        return Tokenizer(lambda s: tok.encode(s, add_special_tokens=False),
                         lambda ids: tok.decode(ids, skip_special_tokens=True), chat_template=template)
    return None
