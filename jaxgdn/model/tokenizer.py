"""Tokenizer loading from a checkpoint directory: tokenizer.json via `tokenizers`, else AutoTokenizer."""

from __future__ import annotations

from pathlib import Path


class Tokenizer:
    """encode(text) -> ids; decode(ids) -> text."""

    def __init__(self, encode, decode, eos_token_ids: tuple[int, ...] = ()):
        self.encode, self.decode, self.eos_token_ids = encode, decode, eos_token_ids


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships none (token-id prompts still work)."""
    path = Path(path)
    if (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        return Tokenizer(lambda s: tok.encode(s).ids, lambda ids: tok.decode(list(ids), skip_special_tokens=True))
    if (path / "tokenizer_config.json").exists():
        try:
            from transformers import AutoTokenizer
        except ImportError:
            return None
        tok = AutoTokenizer.from_pretrained(str(path))
        return Tokenizer(lambda s: tok.encode(s, add_special_tokens=False), lambda ids: tok.decode(ids, skip_special_tokens=True))
    return None
