"""The server's incremental detokenizer (serve/text.TextStream) against decoding the whole output at once, on a
byte-level BPE whose tokens split multi-byte characters, fed in random chunks; and its stop strings."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxgdn.model.tokenizer import from_tokenizers
from jaxgdn.serve.text import TextStream

CORPUS = ["The answer is 42. Größe, naïve café — 東京タワー 🚀🚀 ok!", "x = y + 1\n\tprint(x)  # ünïcödé 你好世界",
          "emoji 👩‍👩‍👧 and spaces   here", "#### 12\nQuestion: Tia has 23 eggs."]


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return from_tokenizers(tok)


def stream(tokenizer, ids, rng, stop=()):
    s, sent, i = TextStream(tokenizer.decode, list(stop)), "", 0
    while i < len(ids) and not s.stopped:
        n = rng.randint(1, 3)
        sent += s.add(ids[i:i + n], final=i + n >= len(ids))
        i += n
    return sent, s


def test_incremental_text_equals_whole_decode(tokenizer):
    rng = random.Random(0)
    assert tokenizer.max_token_bytes >= 4  # a byte-level key holds at least the bytes it stands for
    for trial in range(200):
        text = "".join(rng.choice(CORPUS)[rng.randint(0, 10):] for _ in range(rng.randint(1, 3)))
        ids = tokenizer.encode(text)
        if trial % 3 == 0:  # random tokens: cut characters that never complete
            ids = [rng.randrange(300) for _ in range(rng.randint(1, 40))]
        sent, s = stream(tokenizer, ids, rng)
        assert sent == tokenizer.decode(ids) == s.text


def test_stop_strings_cut_the_text_and_hold_back_what_may_become_one(tokenizer):
    rng = random.Random(1)
    for text in CORPUS:
        ids = tokenizer.encode(text)
        for stop in ("42", "café", "東京", "🚀", "\n", "print(x)", "absent"):
            sent, s = stream(tokenizer, ids, rng, [stop])
            full = tokenizer.decode(ids)
            assert sent == full.split(stop)[0]
            assert s.stopped == (stop in full)
