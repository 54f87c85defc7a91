"""Why serve/entrypoints/detokenize.py keeps its own IncrementalText instead of tokenizers' DecodeStream: for an
output cut inside a multi-byte character (a max_tokens cut), DecodeStream never yields the U+FFFD the full decode
ends with, while IncrementalText's pieces plus its flush always add up to the full decode. Should a tokenizers
release flush, the first assertion fails, and the library can take over."""
from __future__ import annotations

import pytest

from serve.entrypoints.detokenize import IncrementalText

TEXT = "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🤖🦙"          # characters of four UTF-8 bytes, split across byte-level tokens


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_decode_stream_loses_a_cut_character_incremental_text_keeps_it(tokenizer):
    from tokenizers.decoders import DecodeStream

    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    cuts = [n for n in range(1, len(ids) + 1) if tokenizer.decode(ids[:n], skip_special_tokens=True).endswith("\ufffd")]
    assert cuts, "no prefix of TEXT ends inside a character: pick another TEXT"
    for n in cuts:
        full = tokenizer.decode(ids[:n], skip_special_tokens=True)
        stream = DecodeStream(skip_special_tokens=True)
        streamed = "".join(p for p in (stream.step(tokenizer._tokenizer, i) for i in ids[:n]) if p)
        assert streamed != full, n
        ours = IncrementalText(tokenizer)
        assert "".join(ours.push(i) for i in ids[:n]) + ours.flush() == full, n
