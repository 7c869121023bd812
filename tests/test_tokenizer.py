"""The packaged V4 tokenizer gives the ids of docs/PROTOCOLS.md, Special tokens."""

from ds4.tokenizer import Tokenizer


def test_special_tokens_and_context_dependent_merges():
    tok = Tokenizer.for_model()
    assert tok.encode("<｜begin▁of▁sentence｜><｜end▁of▁sentence｜><｜User｜><｜Assistant｜>") == [
        0, 1, 128803, 128804]
    assert tok.encode("<think></think>") == [128821, 128822]
    assert tok.encode("\n\n<｜DSML｜tool_calls>\n") == [271, 30, 128825, 72461, 4941, 12548, 1018]
    assert tok.encode("</｜DSML｜tool_calls>") == [1718, 128825, 72461, 4941, 12548, 32]


def test_bytes_round_trip_through_split_utf8():
    tok = Tokenizer.for_model()
    text = "naïve 你好 — ok\n"
    ids = tok.encode(text)
    assert tok.decode_bytes(ids) == text.encode("utf-8")
    assert tok.vocab_size == 129280


def test_ids_outside_the_vocabulary_stand_for_no_bytes():
    tok = Tokenizer.for_model()
    for token_id in (-1, tok.vocab_size, 2**40):
        assert tok.token_bytes(token_id) == b""
    assert tok.decode([-1, 33310]) == tok.decode([33310])
