"""`python -m train.prepare`: documents in, shards (or nanoGPT's two files) out.

Every tokenizer is built here (`tiny_tokenizers`): GPT-2's is replaced by a tiktoken
encoding with GPT-2's regex and a few learned merges, so nothing is downloaded.
"""

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import regex
import tiktoken

from repository import ROOT
from tiny_tokenizers import EOT, GPT2_REGEX, gpt2_like_encoding, hf_bpe_json
from train import prepare as prep
from train.data import (
    DATASET_META,
    SHARD_HEADER_INTS,
    SHARD_MAGIC,
    SHIPPED_CORPUS,
    open_dataset,
    read_shard_header,
)
from train.errors import MISTAKE_EXIT_STATUS
from train.tokenizer import ByteTokenizer, HFTokenizer, TiktokenTokenizer

CORPUS = SHIPPED_CORPUS.read_text(encoding="utf-8")
DOCS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n",
    "héllo  wörld\n\n\n  spaces   and\ttabs 😀 they'll we're\r\nend",
    "",  # an empty document still gets its end-of-text id
    "x" * 40 + "\n" + "y\n" * 20 + "  \n\n",
    f"a literal {EOT} inside a document is plain text",
]
# Pieces that make the regex's whitespace alternatives disagree when cut naively.
ALPHABET = [" ", "  ", "\n", "\n\n", "\t", "\r", "\r\n", "\u00a0", "\x1c", "\u2028", "\x0b",
            "a", "Zz", "é", "7", "42", "'s", "'", "'ll", ".", "!?", "😀", "x"]
HANDPICKED = ["x\nY", "x\n Y", " \nY", "x\n\nY", "a\n\n\nb", "\n\nA", "a\n\nb\nc", "a \n b\nc",
              "x\r\nY", "end\n", "\n", "", "x\n'll", "1\n2\n3", "é\n😀\n.", "a\n\u00a0b"]


def adversarial(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return HANDPICKED + ["".join(rng.choice(ALPHABET, size=rng.integers(1, 30)))
                         for _ in range(n)]


@pytest.fixture(scope="module")
def encoding():
    return gpt2_like_encoding(CORPUS[:30000])


@pytest.fixture
def gpt2(monkeypatch, encoding):
    """`--tokenizer=gpt2` gives the local encoding (the dataset's meta still says gpt2)."""
    tok = TiktokenTokenizer(encoding, "gpt2")
    monkeypatch.setattr(TiktokenTokenizer, "gpt2", classmethod(lambda cls: tok))
    return tok


@pytest.fixture(scope="module")
def hf_json(tmp_path_factory):
    return hf_bpe_json(CORPUS[:50000], tmp_path_factory.mktemp("hf") / "tokenizer.json")


def _tokenizer(kind, request):
    """(the `tokenizer=` argument, the tokenizer it gives)."""
    if kind == "bytes":
        return "bytes", ByteTokenizer()
    if kind == "gpt2":
        return "gpt2", request.getfixturevalue("gpt2")
    path = request.getfixturevalue("hf_json")
    return str(path), HFTokenizer(path)


def _jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _read_split(out, split):
    meta = json.loads((out / DATASET_META).read_text())
    if meta["layout"] == "nanogpt":
        return np.fromfile(out / f"{split}.bin", np.uint16)
    parts = []
    for path in sorted(out.glob(f"*_{split}_*.bin")):
        count = read_shard_header(path)
        parts.append(np.fromfile(path, np.uint16, offset=SHARD_HEADER_INTS * 4))
        assert parts[-1].size == count
    return np.concatenate(parts)


def _stream(out):
    return np.concatenate([_read_split(out, "train"), _read_split(out, "val")])


def _files(out):
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def _expected(tok, docs, before):
    eot = [tok.eot_id]
    ids = [i for d in docs for i in (eot + tok.encode(d) if before else tok.encode(d) + eot)]
    text = "".join(EOT + d if before else d + EOT for d in docs)
    return np.array(ids, np.uint16), text


# ------------------------------------------------------------------ safe cut points


def _pretokens(pattern, pieces):
    return [t for p in pieces for t in regex.findall(pattern, p)]


def _blocks(text, size):
    return [(text[i:i + size], len(text[i:i + size].encode())) for i in
            range(0, len(text), size)] or [("", 0)]


def _pieces(text, size, rule):
    out = list(prep.cut_pieces(_blocks(text, size), rule))
    assert [last for *_, last in out] == [False] * (len(out) - 1) + [True]
    assert sum(n for _, n, _ in out) == len(text.encode())
    return [p for p, _, _ in out]


def test_gpt2_regex_spellings_agree_with_the_one_written_here():
    from tiktoken_ext.openai_public import r50k_pat_str

    assert r50k_pat_str in prep.GPT2_PATTERNS  # the installed tiktoken's gpt2 is cut
    assert len(set(prep.GPT2_PATTERNS)) == 3
    for text in [CORPUS[:100000], *adversarial(300)]:
        expected = regex.findall(GPT2_REGEX, text)
        for pattern in prep.GPT2_PATTERNS:
            assert regex.findall(pattern, text) == expected, (pattern, text)


def test_newline_cuts_keep_pretokens_and_ids_on_adversarial_strings(encoding):
    from tiktoken_ext.openai_public import r50k_pat_str

    # tiktoken's Rust regex engine, with the regex as written here and as tiktoken spells it
    encodings = [encoding, gpt2_like_encoding(CORPUS[:30000], pattern=r50k_pat_str)]
    texts = adversarial(400)
    cuts = 0
    for text in texts:
        wholes = [e.encode_ordinary(text) for e in encodings]
        for size in (1, 2, 3, 5):
            pieces = _pieces(text, size, prep.CUT_GPT2_NEWLINE)
            cuts += len(pieces) - 1
            assert "".join(pieces) == text
            assert _pretokens(GPT2_REGEX, pieces) == regex.findall(GPT2_REGEX, text), pieces
            for e, whole in zip(encodings, wholes, strict=True):
                assert [i for p in pieces for i in e.encode_ordinary(p)] == whole, pieces
    assert cuts > 200  # (261 with this seed)
    # The check has teeth: cutting after every newline changes the pre-tokens.
    naive = [text.replace("\n", "\n\0").split("\0") for text in texts]
    assert any(_pretokens(GPT2_REGEX, p) != regex.findall(GPT2_REGEX, "".join(p)) for p in naive)


@pytest.mark.parametrize("spelling", ["written here", "tiktoken's"])
def test_newline_cuts_keep_ids_on_the_shipped_corpus(spelling, encoding):
    if spelling == "tiktoken's":
        from tiktoken_ext.openai_public import r50k_pat_str

        encoding = gpt2_like_encoding(CORPUS[:30000], pattern=r50k_pat_str)
    tok = TiktokenTokenizer(encoding)
    assert prep.cut_rule(tok) == prep.CUT_GPT2_NEWLINE
    pieces = _pieces(CORPUS, 1000, prep.cut_rule(tok))
    assert len(pieces) > 900 and "".join(pieces) == CORPUS
    ids = np.concatenate([prep._Encoder(tok, True).encode(p) for p in pieces])
    np.testing.assert_array_equal(ids, encoding.encode_ordinary(CORPUS))


def test_cut_rules(encoding, hf_json):
    assert prep.cut_rule(ByteTokenizer()) == prep.CUT_ANYWHERE
    assert prep.cut_rule(TiktokenTokenizer(encoding)) == prep.CUT_GPT2_NEWLINE
    other = tiktoken.Encoding(name="words", pat_str=r"\S+|\s+",
                              mergeable_ranks={bytes([i]): i for i in range(256)},
                              special_tokens={EOT: 256})
    assert prep.cut_rule(TiktokenTokenizer(other)) == prep.CUT_NEVER
    assert prep.cut_rule(HFTokenizer(hf_json)) == prep.CUT_NEVER
    text = "ab\nCd\nef"
    assert _pieces(text, 3, prep.CUT_NEVER) == [text]
    assert _pieces(text, 3, prep.CUT_ANYWHERE) == ["ab\n", "Cd\n", "ef"]
    assert _pieces(text, 3, prep.CUT_GPT2_NEWLINE) == ["ab\n", "Cd\n", "ef"]
    with pytest.raises(ValueError, match="rule='sometimes'"):
        list(prep.cut_pieces([("a", 1)], "sometimes"))


@pytest.mark.parametrize("kind", ["bytes", "gpt2", "hf"])
def test_encoder_survives_pickling_for_spawned_workers(kind, request):
    _, tok = _tokenizer(kind, request)
    chunk = [(d, True, True) for d in DOCS]
    encoder = prep._Encoder(tok, before=True)
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(encoder))(chunk), encoder(chunk))


# ---------------------------------------------------------------------- prepare()


@pytest.mark.parametrize("fmt", ["shards", "nanogpt"])
@pytest.mark.parametrize("kind", ["bytes", "gpt2", "hf"])
def test_round_trip_with_eot_per_format(kind, fmt, request, tmp_path):
    spec, tok = _tokenizer(kind, request)
    src = _jsonl(tmp_path / "docs.jsonl", DOCS)
    out = tmp_path / "out"
    result = prep.prepare(src, out, tokenizer=spec, format=fmt, workers=1, chunk_bytes=16)
    before = fmt == "shards"
    ids, text = _expected(tok, DOCS, before)
    stream = _stream(out)
    np.testing.assert_array_equal(stream, ids)
    assert tok.decode(stream) == text
    assert (stream == tok.eot_id).sum() == len(DOCS)  # a quoted <|endoftext|> is text
    assert (stream[0] == tok.eot_id) == before and (stream[-1] == tok.eot_id) == (not before)
    n = ids.size
    meta = json.loads((out / DATASET_META).read_text())
    assert meta == {
        "layout": fmt, "vocab_size": tok.vocab_size, "tokenizer": meta["tokenizer"],
        "eot_id": tok.eot_id, "eot_position": "before" if before else "after",
        "documents": len(DOCS), "train_tokens": int(n * 0.9), "val_tokens": n - int(n * 0.9),
        "source": str(src.absolute()), "format_version": 1}
    assert (result.documents, result.train_tokens, result.val_tokens) == (
        len(DOCS), int(n * 0.9), n - int(n * 0.9))
    if kind == "hf":
        assert meta["tokenizer"] == {"kind": "huggingface", "file": "tokenizer.json",
                                     "eot": EOT}
        assert (out / "tokenizer.json").read_bytes() == Path(spec).read_bytes()
    else:
        assert meta["tokenizer"] == tok.to_meta()
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        (["tokenizer.json"] if kind == "hf" else []) + [DATASET_META] + (
            ["tokens_train_000000.bin", "tokens_val_000000.bin"] if before
            else ["train.bin", "val.bin"]))


@pytest.mark.parametrize("kind", ["bytes", "gpt2", "hf"])
def test_output_is_byte_identical_for_one_and_two_workers(kind, request, tmp_path,
                                                          monkeypatch):
    spec, _ = _tokenizer(kind, request)
    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    (src / "a.txt").write_text(CORPUS[:200_000])  # one long document, cut into pieces
    for i, doc in enumerate(DOCS):
        (src / "b" / f"{i}.txt").write_text(doc)
    pools = []
    monkeypatch.setattr(prep, "_pool_context",
                        lambda real=prep._pool_context: pools.append(1) or real())
    files = {}
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        prep.prepare(src, out, tokenizer=spec, workers=workers, chunk_bytes=8192,
                     shard_tokens=20_000, val_tokens=5_000)
        files[workers] = _files(out)
    assert pools == [1]  # the second run used a pool
    assert len(files[1]) > 4 and files[1] == files[2]


def test_workers_started_by_a_forkserver_give_the_same_files(gpt2, tmp_path, monkeypatch):
    """Another thread running (a trainer's, tqdm's): the workers do not fork this process;
    they get the tokenizer pickled (a tiktoken encoding that no registry knows)."""
    src = _jsonl(tmp_path / "docs.jsonl", [CORPUS[:40_000], *DOCS])
    prep.prepare(src, tmp_path / "one", tokenizer="gpt2", workers=1, chunk_bytes=4096)
    monkeypatch.setattr(prep.threading, "active_count", lambda: 2)
    assert prep._pool_context().get_start_method() != "fork"
    prep.prepare(src, tmp_path / "two", tokenizer="gpt2", workers=2, chunk_bytes=4096)
    assert _files(tmp_path / "one") == _files(tmp_path / "two")


def test_split_sizes_shards_and_headers(tmp_path):
    src = tmp_path / "doc.txt"
    src.write_text("abcdefghij" * 100)  # 1000 bytes: 1001 ids with the end-of-text id
    out = tmp_path / "out"
    result = prep.prepare(src, out, tokenizer="bytes", val_tokens=100, shard_tokens=300,
                          name="shake", workers=1)
    assert [p.name for p in result.files["train"]] == [
        f"shake_train_{k:06d}.bin" for k in range(4)]
    assert [read_shard_header(p) for p in result.files["train"]] == [300, 300, 300, 1]
    assert [read_shard_header(p) for p in result.files["val"]] == [100]
    header = np.fromfile(result.files["val"][0], np.int32, SHARD_HEADER_INTS)
    assert header[:3].tolist() == [SHARD_MAGIC, 1, 100] and not header[3:].any()
    assert bytes(_stream(out)[1:].astype(np.uint8)) == src.read_bytes()

    out = tmp_path / "nano"
    result = prep.prepare(src, out, tokenizer="bytes", format="nanogpt", val_fraction=0.25,
                          workers=1)
    assert (result.train_tokens, result.val_tokens) == (750, 251)
    assert (out / "train.bin").stat().st_size == 1500 and (out / "val.bin").stat().st_size == 502
    assert "1 document, 750 train / 251 val tokens in 1 + 1 files" in result.summary()

    with pytest.raises(ValueError, match=r"gives 1,001 tokens: too few .* --val_tokens=1001"):
        prep.prepare(src, tmp_path / "small", tokenizer="bytes", val_tokens=1001, workers=1)


def test_folder_and_jsonl_inputs_in_sorted_order(tmp_path):
    src = tmp_path / "src"
    for rel, text in {"b/2.txt": "two", "a/1.txt": "one", "a/sub/0.txt": "zero",
                      ".hidden/x.txt": "hidden", "notes.md": "not a document",
                      "a/.swap.txt": "hidden too"}.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    (src / "c.jsonl").write_text('{"text": "three"}\n\n   \n{"text": "four\\n"}\n')
    out = tmp_path / "out"
    result = prep.prepare(src, out, tokenizer="bytes", format="nanogpt", workers=1,
                          val_tokens=1)
    assert result.documents == 5
    assert ByteTokenizer().decode(_stream(out)) == "".join(
        d + EOT for d in ["one", "zero", "two", "three", "four\n"])
    assert [p.name for p, _ in prep.input_files(src)] == [
        "1.txt", "0.txt", "2.txt", "c.jsonl"]


@pytest.mark.parametrize(("line", "why"), [
    ('{"text": 3}', "text of type int"),
    ('{"body": "x"}', "keys ['body']"),
    ('["text"]', "got a list"),
    ("{text: x}", "not a JSON line"),
])
def test_a_bad_jsonl_line_is_one_line_naming_file_and_line(line, why, tmp_path, capsys):
    src = tmp_path / "docs.jsonl"
    src.write_text(f'{{"text": "ok"}}\n\n{line}\n{{"text": "never read"}}\n')
    with pytest.raises(ValueError, match=f"docs.jsonl:3: .*{re.escape(why)}") as err:
        prep.prepare(src, tmp_path / "out", tokenizer="bytes", workers=1)
    assert "\n" not in str(err.value)
    code = prep.main([str(src), f"--out={tmp_path / 'cli'}", "--tokenizer=bytes",
                      "--workers=2", "--no_progress"])
    captured = capsys.readouterr()
    assert code == MISTAKE_EXIT_STATUS and captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith(f"error: {src}:3: ")


@pytest.mark.parametrize("bad", ["latin1", "json", "no_text"])
@pytest.mark.parametrize("out_was", ["absent", "kept_files"])
def test_a_bad_input_leaves_out_as_it_was(tmp_path, bad, out_was):
    src = tmp_path / "in"
    src.mkdir()  # a good document first, so the split files are begun before the error
    (src / "a.txt").write_text("good text\n" * 2000)
    if bad == "latin1":
        (src / "b.txt").write_bytes("caf\xe9".encode("latin-1"))
    else:
        (src / "b.jsonl").write_text('{"text": "ok"}\n' + ("{bad" if bad == "json" else
                                                            '{"body": "x"}') + "\n")
    out = tmp_path / "parent" / "out"
    if out_was == "kept_files":
        out.mkdir(parents=True)
        (out / "README").write_text("mine")
    with pytest.raises(ValueError):
        prep.prepare(src, out, tokenizer="bytes", workers=1, chunk_bytes=64, overwrite=True)
    if out_was == "absent":
        assert not (tmp_path / "parent").exists()
    else:
        assert [p.name for p in out.iterdir()] == ["README"]


def test_relative_input_is_stored_as_an_absolute_source(tmp_path, monkeypatch):
    (tmp_path / "doc.txt").write_text("some text\n" * 50)
    monkeypatch.chdir(tmp_path)
    prep.prepare("doc.txt", "out", tokenizer="bytes", workers=1)
    meta = json.loads((tmp_path / "out" / DATASET_META).read_text())
    assert meta["source"] == str(tmp_path / "doc.txt")


def test_text_that_is_not_utf8_names_the_byte(tmp_path):
    src = tmp_path / "latin1.txt"
    src.write_bytes("é".encode() * 3000 + "ü".encode("latin-1") + b"tail")
    with pytest.raises(ValueError, match=r"latin1.txt: not UTF-8 text \(byte 6,000 "):
        prep.prepare(src, tmp_path / "out", tokenizer="bytes", workers=1, chunk_bytes=1001)


def test_existing_out_is_refused_and_overwrite_keeps_other_files(tmp_path):
    src = tmp_path / "doc.txt"
    src.write_text("some text\n" * 50)
    out = tmp_path / "out"
    out.mkdir()
    (out / "README").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not empty; pass --overwrite"):
        prep.prepare(src, out, tokenizer="bytes", workers=1)
    prep.prepare(src, out, tokenizer="bytes", workers=1, overwrite=True, name="old",
                 shard_tokens=100)
    assert len(list(out.glob("old_train_*.bin"))) == 5
    prep.prepare(src, out, tokenizer="bytes", workers=1, overwrite=True, format="nanogpt")
    assert sorted(p.name for p in out.iterdir()) == [
        "README", DATASET_META, "train.bin", "val.bin"]
    assert (out / "README").read_text() == "mine"
    assert open_dataset(out).num_tokens("val") == 51
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file; expected a folder"):
        prep.prepare(src, tmp_path / "file", tokenizer="bytes", workers=1)


def test_tokenizers_that_cannot_write_the_files_are_refused(tmp_path, hf_json):
    from tokenizers import Tokenizer, models

    src = tmp_path / "doc.txt"
    src.write_text("w1 w2 w3\n" * 20)
    big = tmp_path / "big.json"
    model = models.WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0")
    Tokenizer(model).save(str(big))
    with pytest.raises(ValueError, match=r"--eot=TOKEN"):  # no end-of-text token in it
        prep.prepare(src, tmp_path / "a", tokenizer=str(big), workers=1)
    with pytest.raises(ValueError, match=r"70,000 ids; expected at most 65,536"):
        prep.prepare(src, tmp_path / "b", tokenizer=str(big), eot="w9", workers=1)
    with pytest.raises(ValueError, match=r"--eot='<pad>': no such token"):
        prep.prepare(src, tmp_path / "c", tokenizer=str(hf_json), eot="<pad>", workers=1)
    with pytest.raises(ValueError, match=r"--eot='</s>' is for a tokenizer.json"):
        prep.prepare(src, tmp_path / "d", tokenizer="bytes", eot="</s>", workers=1)
    with pytest.raises(FileNotFoundError, match="tokenizer 'nope.json': no such file"):
        prep.prepare(src, tmp_path / "e", tokenizer="nope.json", workers=1)
    assert not any((tmp_path / x).exists() for x in "abcde")  # refused before writing


def test_eot_names_a_tokenizer_json_token(tmp_path):
    src = tmp_path / "doc.txt"
    src.write_text(CORPUS[:3000])
    path = hf_bpe_json(CORPUS[:20000], tmp_path / "pad.json", special=("<pad>", "<doc>"))
    with pytest.raises(ValueError, match=r"has no end-of-text token .* pass --eot=TOKEN"):
        prep.prepare(src, tmp_path / "a", tokenizer=str(path), workers=1)
    out = tmp_path / "b"
    prep.prepare(src, out, tokenizer=str(path), eot="<doc>", workers=1)
    meta = json.loads((out / DATASET_META).read_text())
    assert meta["eot_id"] == 1 and meta["tokenizer"]["eot"] == "<doc>"
    data = open_dataset(out)
    assert data.tokenizer.eot_id == 1 and _stream(out)[0] == 1


@pytest.mark.parametrize(("option", "value", "message"), [
    ("format", "arrow", "--format='arrow': expected one of shards, nanogpt"),
    ("val_fraction", 1.0, r"--val_fraction=1.0: expected a value in \(0, 1\)"),
    ("val_tokens", 0, "--val_tokens=0: expected a positive count"),
    ("shard_tokens", 0, "--shard_tokens=0: expected 1 .. 2147483647"),
    ("workers", 0, "--workers=0: expected at least 1"),
    ("name", "x_val", "--name='x_val': expected"),
    ("name", "a/b", "--name='a/b': expected"),
])
def test_bad_options_name_the_flag(option, value, message, tmp_path):
    src = tmp_path / "doc.txt"
    src.write_text("text")
    with pytest.raises(ValueError, match=message):
        prep.prepare(src, tmp_path / "out", tokenizer="bytes", **{option: value})


def test_missing_or_empty_input_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="input 'missing.txt': no such file"):
        prep.prepare("missing.txt", tmp_path / "out", tokenizer="bytes")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="holds no"):
        prep.prepare(empty, tmp_path / "out", tokenizer="bytes")


def test_gpt2_offline_and_uncached_is_one_line(tmp_path, monkeypatch, capsys):
    import tiktoken.load
    import tiktoken.registry

    cache = tmp_path / "empty_cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # nothing loaded before
    tried = []

    def offline(url):
        tried.append(url)
        raise ConnectionError(f"no network for {url}")

    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    src = tmp_path / "doc.txt"
    src.write_text("text")
    code = prep.main([str(src), f"--out={tmp_path / 'out'}", "--no_progress"])
    err = capsys.readouterr().err
    assert code == MISTAKE_EXIT_STATUS and tried and tried[0].startswith("https://")
    assert err.count("\n") == 1 and err.startswith("error: tiktoken could not load GPT-2's")
    assert str(cache) in err and "TIKTOKEN_CACHE_DIR" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("kind", "fmt"), [("hf", "shards"), ("gpt2", "nanogpt"),
                                           ("bytes", "shards")])
def test_open_dataset_reads_the_folder_and_decodes_a_window(kind, fmt, request, tmp_path):
    spec, tok = _tokenizer(kind, request)
    src = tmp_path / "play.txt"
    src.write_text(CORPUS[:20000])
    out = tmp_path / "out"
    prep.prepare(src, out, tokenizer=spec, format=fmt, shard_tokens=2000, workers=1)
    data = open_dataset(out)
    assert data.vocab_size == tok.vocab_size and data.tokenizer == tok
    assert data.num_tokens("train") + data.num_tokens("val") == len(tok.encode(CORPUS[:20000])) + 1
    x, y = data.batch("train", 0, batch_size=4, block_size=32)
    assert x.shape == (1, 4, 32) and (x[0, :, 1:] == y[0, :, :-1]).all()
    for row in x[0]:
        window = data.tokenizer.decode(row)
        assert window.replace(EOT, "") in CORPUS[:20000], window


def test_command_line_writes_a_dataset(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.txt").write_text(CORPUS[i * 5000:(i + 1) * 5000])
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "train.prepare", str(src), f"--out={out}", "--tokenizer=bytes",
         "--workers=2", "--shard_tokens=4000", "--val_tokens=3000"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""  # not a terminal: no progress bar
    assert run.stdout.startswith(f"{out}: 3 documents, 12,003 train / 3,000 val tokens in "
                                 "4 + 1 files; 0.0 MB of text in ")
    assert run.stdout.count("\n") == 1 and run.stdout.rstrip().endswith("MB/s)")
    data = open_dataset(out)
    assert data.num_tokens("train") == 12_003 and data.num_tokens("val") == 3_000
