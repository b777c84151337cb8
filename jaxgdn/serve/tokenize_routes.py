"""vLLM's tokenizer endpoints: /tokenize, /detokenize and /tokenizer_info. lm-evaluation-harness's
`local-completions` finds them (tokenizer_backend "auto" or "remote") and counts a loglikelihood request's
context tokens with them."""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict

from .inputs import encode_text
from .protocol import BadRequest


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt: str
    add_special_tokens: bool = False  # the checkpoints' tokenizers add none either way


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    tokens: list[int]


def add_tokenizer_routes(app: FastAPI, state) -> None:
    """state: the server's ServerState (tokenizer, max_model_len, model_name)."""

    def tokenizer():
        if state.tokenizer is None:
            raise BadRequest(f"model {state.model_name} has no tokenizer", status=404)
        return state.tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ids = await encode_text(tokenizer(), state.max_model_len + 1, body.prompt, "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        tok = tokenizer()
        try:
            return {"prompt": tok.decode(body.tokens)}
        except Exception as e:  # noqa: BLE001 - ids the vocabulary does not have
            raise BadRequest(f"tokens cannot be decoded: {e}", "tokens") from None

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = tokenizer()
        return {"tokenizer_class": "tokenizers", "model": state.model_name, "eos_token": tok.eos_token,
                "bos_token": None, "pad_token": None, "chat_template": tok.chat_template,
                "model_max_length": state.max_model_len}
