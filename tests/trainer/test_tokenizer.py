"""`train.tokenizer`: characters, bytes, tiktoken encodings and `tokenizer.json` files, each
with its end-of-text id, decoding of padded ids, and its `to_meta`/`from_meta` round trip.
Every tokenizer is built here (`tiny_tokenizers`); nothing is downloaded."""

import json
import os
import pickle
import sys
import tempfile

import pytest

from tiny_tokenizers import EOT, gpt2_like_encoding, hf_bpe_json
from train.data import SHIPPED_CORPUS
from train.tokenizer import (
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    from_meta,
    get_tokenizer,
)

TEXT = SHIPPED_CORPUS.read_text(encoding="utf-8")[:30000]
SAMPLE = "Hé  said:\n\n  'tis 42 😀\r\nend"


@pytest.fixture(scope="module")
def encoding():
    return gpt2_like_encoding(TEXT)


@pytest.fixture(scope="module")
def hf_json(tmp_path_factory):
    return hf_bpe_json(TEXT, tmp_path_factory.mktemp("hf") / "tokenizer.json")


def test_bytes_are_utf8_with_eot_256_and_padded_ids_decode_to_nothing():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eot_id) == (257, 256)
    assert tok.encode("hé") == [104, 195, 169]
    assert tok.decode([104, 195, 169, 256, 300, 104, -1]) == f"hé{EOT}h"
    assert tok.decode([195]) == "\ufffd"  # half a character: the replacement character
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert from_meta(tok.to_meta()) == tok == get_tokenizer("bytes")


def test_characters_sorted_without_eot():
    tok = CharTokenizer.from_text("hello")
    assert (tok.chars, tok.vocab_size, tok.eot_id) == ("ehlo", 4, None)
    assert tok.encode("hole") == [1, 3, 2, 0] and tok.decode([1, 3, 2, 0, 4, 99]) == "hole"
    with pytest.raises(ValueError, match=r"characters \['!', 'z'\] are not in the vocabulary"):
        tok.encode("z!")
    assert from_meta(tok.to_meta()) == tok != CharTokenizer("ehl")


def test_tiktoken_encodes_ordinary_text_and_decodes_eot(encoding):
    tok = TiktokenTokenizer(encoding)
    assert (tok.vocab_size, tok.eot_id, tok.name) == (encoding.n_vocab, encoding.eot_token,
                                                       "tiny_gpt2")
    ids = tok.encode(SAMPLE + EOT)  # a quoted end-of-text marker is plain text
    assert tok.eot_id not in ids and tok.decode(ids) == SAMPLE + EOT
    assert len(ids) < len((SAMPLE + EOT).encode())  # the learned merges are used
    assert tok.decode([*ids, tok.eot_id, tok.vocab_size, 50303]) == SAMPLE + EOT + EOT
    assert tok.to_meta() == {"kind": "tiktoken", "name": "tiny_gpt2"}
    assert tok == TiktokenTokenizer(encoding) != TiktokenTokenizer(encoding, "other")
    with pytest.raises(ValueError, match="only tiktoken's gpt2 is known"):
        from_meta(tok.to_meta())


def test_gpt2_without_tiktoken_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken fails
    with pytest.raises(OSError, match=r"needs tiktoken: pip install -e '.\[data\]'"):
        get_tokenizer("gpt2")


@pytest.mark.parametrize("cache", ["set", "default"])
def test_gpt2_offline_names_the_cache_folder(cache, tmp_path, monkeypatch):
    import tiktoken.load
    import tiktoken.registry

    monkeypatch.delenv("DATA_GYM_CACHE_DIR", raising=False)
    if cache == "set":
        folder = str(tmp_path)
        monkeypatch.setenv("TIKTOKEN_CACHE_DIR", folder)
    else:
        monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
        # tiktoken's default cache is in the temp folder: an empty one here
        monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
        folder = os.path.join(str(tmp_path), "data-gym-cache")
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    tried = []

    def offline(url):
        tried.append(url)
        raise ConnectionError("offline")

    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    with pytest.raises(OSError, match="could not load GPT-2's encoding") as err:
        TiktokenTokenizer.gpt2()
    assert tried and f"({folder}) here, with TIKTOKEN_CACHE_DIR set to it" in str(err.value)
    assert "\n" not in str(err.value)


def test_tokenizer_json_finds_its_eot_and_reads_specials_as_text(hf_json):
    tok = HFTokenizer(hf_json)
    assert tok.vocab_size == 400 and tok.eot_name == EOT and tok.eot_id == 0
    ids = tok.encode(SAMPLE + EOT)
    assert tok.eot_id not in ids and tok.decode(ids) == SAMPLE + EOT
    assert tok.decode([*ids, 0, 400, 999]) == SAMPLE + EOT + EOT
    again = pickle.loads(pickle.dumps(tok))  # a spawned worker's copy: the same ids
    assert again.encode(SAMPLE + EOT) == ids and again == tok
    assert tok.to_meta() == {"kind": "huggingface", "file": str(hf_json), "eot": EOT}
    assert get_tokenizer(str(hf_json)) == tok


def test_tokenizer_json_eot_by_name_and_from_a_relative_meta(tmp_path):
    path = hf_bpe_json(TEXT, tmp_path / "tokenizer.json", special=("<pad>", "</s>"))
    assert HFTokenizer(path).eot_id == 1  # found as "</s>"
    tok = HFTokenizer(path, eot="<pad>")
    assert (tok.eot_id, tok.eot_name) == (0, "<pad>")
    again = from_meta({"kind": "huggingface", "file": "tokenizer.json", "eot": "<pad>"},
                      root=tmp_path)
    assert again == tok and again.eot_id == 0
    none = hf_bpe_json(TEXT, tmp_path / "none.json", special=("<pad>",))
    assert HFTokenizer(none).eot_id is None
    with pytest.raises(ValueError, match=r"--eot='<eot>': no such token in"):
        HFTokenizer(path, eot="<eot>")


def test_tokenizer_json_errors_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="tokenizer 'missing.json': no such file"):
        HFTokenizer("missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(ValueError, match="is not a Hugging Face tokenizer.json") as err:
        HFTokenizer(bad)
    assert "\n" not in str(err.value)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(OSError, match="needs the tokenizers package"):
        HFTokenizer(bad)


def test_from_meta_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="unknown kind 'sentencepiece'; expected chars"):
        from_meta({"kind": "sentencepiece"})
