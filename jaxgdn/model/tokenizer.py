"""Tokenizer loading from a checkpoint directory: tokenizer.json via `tokenizers`, else AutoTokenizer; and the
checkpoint's chat template (chat_template.jinja, or tokenizer_config.json's "chat_template")."""

from __future__ import annotations

import json
from pathlib import Path


class Tokenizer:
    """encode(text) -> ids; decode(ids) -> text; chat_template: a Jinja template of `messages`, or None.
    max_token_bytes: the most UTF-8 bytes of text one token stands for (from the vocabulary's longest entry;
    an upper bound), so a text of B bytes has at least B / max_token_bytes tokens; None where unknown."""

    def __init__(self, encode, decode, eos_token_ids: tuple[int, ...] = (), chat_template: str | None = None,
                 max_token_bytes: int | None = None, id_to_token=None, backend=None):
        self.encode, self.decode, self.eos_token_ids = encode, decode, eos_token_ids
        self.chat_template = chat_template
        self.max_token_bytes = max_token_bytes
        self.id_to_token = id_to_token or (lambda i: None)  # a token's vocabulary entry (special tokens' names)
        self.backend = backend  # the tokenizers / transformers tokenizer (structured output reads its vocabulary)

    @property
    def eos_token(self) -> str | None:
        """The first end-of-sequence token's name (from the checkpoint's config), or None."""
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None


def load_chat_template(path: str | Path) -> str | None:
    path = Path(path)
    if (path / "chat_template.jinja").exists():
        return (path / "chat_template.jinja").read_text()
    if (path / "tokenizer_config.json").exists():
        template = json.loads((path / "tokenizer_config.json").read_text()).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def _max_token_bytes(vocab) -> int | None:
    # a byte-level key ("Ġ") or a word-piece prefix ("##", "▁") has at least the bytes of the text it stands for
    return max((len(k.encode("utf-8", "surrogatepass")) for k in vocab), default=None)


def from_tokenizers(tok, chat_template: str | None = None) -> Tokenizer:
    """A Tokenizer over a `tokenizers.Tokenizer`. Its batch calls release the GIL, so a server thread that
    encodes a long prompt does not stall the others."""
    return Tokenizer(lambda s: tok.encode_batch([s])[0].ids,
                     lambda ids: tok.decode_batch([list(ids)], skip_special_tokens=True)[0],
                     chat_template=chat_template, max_token_bytes=_max_token_bytes(tok.get_vocab(with_added_tokens=True)),
                     id_to_token=tok.id_to_token, backend=tok)


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it ships none (token-id prompts still work)."""
    path = Path(path)
    template = load_chat_template(path)
    if (path / "tokenizer.json").exists():
        from tokenizers import Tokenizer as HFTokenizer

        out = from_tokenizers(HFTokenizer.from_file(str(path / "tokenizer.json")), template)
    elif (path / "tokenizer_config.json").exists():
        try:
            from transformers import AutoTokenizer
        except ImportError:
            return None
        tok = AutoTokenizer.from_pretrained(str(path))
        out = Tokenizer(lambda s: tok.encode(s, add_special_tokens=False),
                        lambda ids: tok.decode(ids, skip_special_tokens=True), chat_template=template,
                        max_token_bytes=_max_token_bytes(tok.get_vocab()), id_to_token=tok.convert_ids_to_tokens,
                        backend=tok)
    else:
        return None
    out.eos_token_ids = _eos_token_ids(path)
    return out


def _eos_token_ids(path: Path) -> tuple[int, ...]:
    """The checkpoint's end-of-sequence ids (generation_config.json, else config.json), () where it names none."""
    for name in ("generation_config.json", "config.json"):
        if (path / name).exists():
            raw = json.loads((path / name).read_text())
            eos = raw.get("eos_token_id", (raw.get("text_config") or {}).get("eos_token_id"))
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()
