"""Output handling: incremental text equals the whole answer decoded at once, without
decoding the whole answer at every step; stop tokens, length and stop strings."""

import random

import pytest

from sparrow.config import SamplingParams
from sparrow.output import OutputProcessor
from sparrow.tokenizer import qwen_vl_tokenizer


@pytest.fixture(scope="module")
def tok():
    return qwen_vl_tokenizer()


class CountingTokenizer:
    """The real tokenizer, counting how many ids each decode call reads."""

    def __init__(self, tok):
        self.tok, self.read = tok, []

    def decode(self, ids, **kwargs):
        self.read.append(len(ids))
        return self.tok.decode(ids, **kwargs)


@pytest.mark.parametrize("seed", range(5))
def test_incremental_text_equals_one_decode_and_reads_a_short_tail(tok, seed):
    rng = random.Random(seed)
    text = "A red square moves left, then a blue circle — ünïcödé 🎥 text! " * 4
    ids = tok(text, add_special_tokens=False)["input_ids"]
    ids = ids + [rng.randrange(len(tok)) for _ in range(40)] + ids      # random ids between (partial UTF-8)
    counting = CountingTokenizer(tok)
    out = OutputProcessor(counting, SamplingParams(max_new_tokens=10_000), frozenset())
    shown, i = "", 0
    while i < len(ids):
        n = rng.randint(1, 5)
        shown += out.push(ids[i:i + n]).text
        i += n
    assert shown == out.final_text
    assert shown == tok.decode(ids, skip_special_tokens=True)
    assert max(counting.read) < len(ids) // 3                              # never the whole answer again


def test_stop_token_length_and_stop_string(tok):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok("one two three four", add_special_tokens=False)["input_ids"]
    out = OutputProcessor(tok, SamplingParams(max_new_tokens=100), frozenset({eos}))
    d = out.push(ids[:2] + [eos] + ids[2:])
    assert d.finish == "stop" and out.token_ids == ids[:2] + [eos]       # kept, as HF generate keeps EOS
    out = OutputProcessor(tok, SamplingParams(max_new_tokens=3), frozenset({eos}))
    assert out.push(ids[:2]).finish is None and out.push(ids[2:]).finish == "length" and len(out.token_ids) == 3
    out = OutputProcessor(tok, SamplingParams(max_new_tokens=100, stop=("three",)), frozenset())
    texts = [out.push([t]).text for t in ids]
    assert "".join(texts) == "one two " and out.push([]).finish in (None, "stop")
