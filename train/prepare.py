"""Tokenize text into a training dataset: `python -m train.prepare INPUT --out=DIR`.

INPUT is a text file (one document), a folder (each `*.txt` under it one document and
each `*.jsonl` one document per line, in the order of their sorted relative paths;
hidden files and folders skipped), or a JSON-lines file (`.jsonl` or `.json`: each
line's `text` field one document; blank lines skipped). Text is read as UTF-8, byte for
byte (no newline translation).

DIR receives:

- `--format=shards` (default): modded-nanogpt's shards, `{name}_train_000000.bin, ...`
  and `{name}_val_000000.bin, ...`, each a 256-int32 header (magic 20240520, version 1,
  token count) then at most `--shard_tokens` uint16 ids; the end-of-text id comes BEFORE
  each document (modded-nanogpt's `data/fineweb.py` prepends it as a document-start
  marker);
- `--format=nanogpt`: nanoGPT's `train.bin` and `val.bin` (raw uint16 ids, no header);
  the end-of-text id comes AFTER each document (nanoGPT's
  `data/openwebtext/prepare.py` appends it);
- `dataset.json`: the layout, the vocabulary size, the tokenizer (`to_meta()`), the
  end-of-text id and its position, the document and token counts, the input's absolute
  path;
  with a `tokenizer.json`, a copy of it beside (`"file": "tokenizer.json"`), so the
  folder is self-contained. `python -m train --data=DIR` (`train.data.open_dataset`)
  reads the folder.

The val split is the last `--val_fraction` of the token stream (`n - int(n * (1 -
val_fraction))` tokens, as `TokenDataset.from_text` cuts a text), or its last
`--val_tokens` tokens; the rest is train. The stream goes to a temporary file in DIR
first, then is cut. Ids must fit uint16: a vocabulary over 65,536 ids is refused.

Tokenizers (`--tokenizer`): `gpt2` (tiktoken's GPT-2 BPE; tiktoken downloads it once and
caches it, see `train.tokenizer`), `bytes` (the 256 byte values plus end-of-text, needs
nothing), or the path of a Hugging Face `tokenizer.json` (with `--eot=TOKEN` naming its
end-of-text token when it is none of `<|endoftext|>`, `</s>`, `<eos>`, ...). `tiktoken`
and `tokenizers` come with the `data` extra: `pip install -e ".[train,data]"`.

Tokenization runs in `--workers` processes (default: every CPU), each building its
tokenizer once; documents are sent in chunks of about 1 MiB and the results written in
input order, so the output is byte-identical whatever the number of workers. A document
longer than a chunk (a whole book in one text file) is cut into pieces only where the
tokenizer provably gives the same ids as for the whole document:

- `bytes`: anywhere (each character's bytes are its ids);
- GPT-2's BPE (a tiktoken encoding whose pre-tokenizer is GPT-2's regex, in one of the
  spellings of `GPT2_PATTERNS`): between a
  newline and a non-whitespace character where the newline follows a non-whitespace
  character (`"x\\nY"` -> `"x\\n" | "Y"`). The regex splits the text into pieces and
  BPE merges only inside a piece, so equal pieces give equal ids. The piece holding `x`
  cannot hold the newline (only its whitespace alternatives match a newline, and they
  match only whitespace), and the regex has no look-behind; so the scan of the whole
  text ends a piece before the newline, reads the newline alone (`\\s+(?!\\S)` fails
  before `Y`, then `\\s+` takes one character), and restarts at `Y`, exactly as the scan
  of `"...x\\n"` (whose `\\s+(?!\\S)` takes the final newline) followed by the scan of
  `"Y..."`. No match attempt before the newline reads past it. `tests/trainer/test_prepare.py`
  checks it on the shipped corpus and on adversarial strings;
- a Hugging Face `tokenizer.json`: never (its pre-tokenizer and normalizer are arbitrary),
  so one huge document is tokenized by one process.

`bytes` encodes faster than text travels to a worker (about 100 MB/s of a text file in
one process): `--workers=1` is its fastest setting.

A progress bar over the input's bytes shows on a terminal (`--no_progress` hides it);
the run ends with one line: documents, train/val tokens, files, MB of text per second.
A mistake (a missing input, a bad JSON line, an existing `--out`, an unknown
tokenizer, gpt2 offline and not cached) ends with one `error: ...` line, exit status 2
(`train.errors.MISTAKE_EXIT_STATUS`); a bad input found while reading (text that is not
UTF-8, a bad JSON line) leaves `--out` as it was: what was written is removed, and the
folder too if this run made it.

Examples:
  $ python -m train.prepare data/tinyshakespeare/input.txt --out=data/shakespeare_bytes \\
      --tokenizer=bytes --val_fraction=0.1 --shard_tokens=500000
  $ python -m train --data=data/shakespeare_bytes --n_layer=4
  $ python -m train.prepare corpus.jsonl --out=data/owt --format=nanogpt   # GPT-2 ids
  $ python -m train.prepare books/ --out=data/books --tokenizer=my/tokenizer.json \\
      --eot="</s>" --val_tokens=1000000 --workers=8

From Python, `prepare(...)` takes the same options and returns a `Prepared` record.

References:
  Karpathy, "nanoGPT" (data/openwebtext/prepare.py: train.bin/val.bin, end-of-text
  appended), https://github.com/karpathy/nanoGPT, 2023.
  Jordan et al., "modded-nanogpt" (data/fineweb.py: header + uint16 shards, end-of-text
  prepended), https://github.com/KellerJordan/modded-nanogpt, 2024.
  Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2's byte-level
  BPE and its pre-tokenizer regex), OpenAI, 2019, https://cdn.openai.com/
  better-language-models/language_models_are_unsupervised_multitask_learners.pdf.
  OpenAI, "tiktoken", https://github.com/openai/tiktoken, 2022.
  Hugging Face, "tokenizers", https://github.com/huggingface/tokenizers, 2019.
"""

from __future__ import annotations

import argparse
import codecs
import collections
import contextlib
import dataclasses
import json
import multiprocessing
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from train.data import DATASET_META, write_shard
from train.errors import run_cli
from train.tokenizer import (
    TOKENIZER_NAMES,
    ByteTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    get_tokenizer,
)

__all__ = [
    "CUT_ANYWHERE",
    "CUT_GPT2_NEWLINE",
    "CUT_NEVER",
    "FORMATS",
    "GPT2_PATTERN",
    "GPT2_PATTERNS",
    "Prepared",
    "cut_pieces",
    "cut_rule",
    "input_files",
    "main",
    "prepare",
]

#: GPT-2's pre-tokenizer regex, as its paper's code gives it.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
#: Spellings of the same regex that tiktoken's `gpt2` has used: the contractions grouped;
#: then possessive runs, trailing whitespace first, and a last `\s` (where the earlier
#: alternatives fail, `\s+` takes one character anyway). Any other pattern is not cut.
GPT2_PATTERNS = (
    GPT2_PATTERN,
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""",
)
#: Where a document may be cut (see the module's docstring).
CUT_ANYWHERE, CUT_GPT2_NEWLINE, CUT_NEVER = "anywhere", "gpt2_newline", "never"
FORMATS = ("shards", "nanogpt")
#: Text per chunk sent to a worker (also the block read from a text file at a time).
CHUNK_BYTES = 1 << 20
_UINT16_IDS = 2**16
_TMP = ".prepare_tokens.tmp"  # the token stream before the split (not *.bin: never a shard)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*(_[A-Za-z0-9.-]+)*")


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What `prepare` wrote: the folder, its files and the counts in `dataset.json`."""

    out: Path
    files: dict[str, list[Path]]
    documents: int
    train_tokens: int
    val_tokens: int
    input_bytes: int
    seconds: float

    def summary(self) -> str:
        mb = self.input_bytes / 1e6
        docs = f"{self.documents:,} document{'' if self.documents == 1 else 's'}"
        return (f"{self.out}: {docs}, {self.train_tokens:,} train / "
                f"{self.val_tokens:,} val tokens in {len(self.files['train'])} + "
                f"{len(self.files['val'])} files; {mb:.1f} MB of text in {self.seconds:.1f} s "
                f"({mb / max(self.seconds, 1e-9):.2f} MB/s)")


# ------------------------------------------------------------------------ tokenizer


def cut_rule(tokenizer: Tokenizer) -> str:
    """Where a document may be cut without changing its ids: `CUT_ANYWHERE` for bytes,
    `CUT_GPT2_NEWLINE` for a tiktoken encoding with GPT-2's pre-tokenizer regex,
    `CUT_NEVER` for anything else (a Hugging Face tokenizer's pre-tokenizer is unknown)."""
    if isinstance(tokenizer, ByteTokenizer):
        return CUT_ANYWHERE
    if isinstance(tokenizer, TiktokenTokenizer) and (
            getattr(tokenizer.encoding, "_pat_str", None) in GPT2_PATTERNS):
        return CUT_GPT2_NEWLINE
    return CUT_NEVER


def _load_tokenizer(spec: str | Tokenizer, eot: str | None) -> tuple[Tokenizer, bytes | None]:
    """The tokenizer and, for a `tokenizer.json`, its bytes (copied into the output)."""
    if isinstance(spec, Tokenizer):
        tokenizer = spec
    else:
        if eot is not None and spec in TOKENIZER_NAMES:
            raise ValueError(f"--eot={eot!r} is for a tokenizer.json; --tokenizer={spec} has "
                             "its own end-of-text id")
        tokenizer = get_tokenizer(spec, eot=eot)
    if tokenizer.eot_id is None:
        raise ValueError(f"tokenizer {_describe(tokenizer)} has no end-of-text token (none of "
                         f"{', '.join(HFTokenizer._EOT_CANDIDATES)}); pass --eot=TOKEN naming "
                         "the one written between documents")
    if tokenizer.vocab_size > _UINT16_IDS:
        raise ValueError(f"tokenizer {_describe(tokenizer)} has {tokenizer.vocab_size:,} ids; "
                         f"expected at most {_UINT16_IDS:,} (the files hold uint16 ids)")
    raw = tokenizer.path.read_bytes() if isinstance(tokenizer, HFTokenizer) else None
    return tokenizer, raw


def _describe(tokenizer: Tokenizer) -> str:
    if isinstance(tokenizer, HFTokenizer):
        return repr(str(tokenizer.path))
    return repr(getattr(tokenizer, "name", type(tokenizer).__name__))


class _Encoder:
    """Encodes a chunk of pieces `(text, first, last)` into uint16 ids, the end-of-text id
    before each document's first piece (`before`) or after its last one."""

    def __init__(self, tokenizer: Tokenizer, before: bool):
        self.tokenizer, self.before = tokenizer, before
        self.eot = np.array([tokenizer.eot_id], np.uint16)

    def __call__(self, chunk: Sequence[tuple[str, bool, bool]]) -> np.ndarray:
        parts = []
        for text, first, last in chunk:
            if first and self.before:
                parts.append(self.eot)
            parts.append(self.encode(text))
            if last and not self.before:
                parts.append(self.eot)
        return np.concatenate(parts) if parts else np.zeros(0, np.uint16)

    def encode(self, text: str) -> np.ndarray:
        if isinstance(self.tokenizer, ByteTokenizer):  # the same ids, without a Python list
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint16)
        return np.asarray(self.tokenizer.encode(text), np.uint16)


_WORKER_ENCODER: _Encoder | None = None


def _init_worker(encoder: _Encoder) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder


def _encode_in_worker(chunk: Sequence[tuple[str, bool, bool]]) -> np.ndarray:
    return _WORKER_ENCODER(chunk)


# ---------------------------------------------------------------------------- input


def input_files(path: str | os.PathLike) -> list[tuple[Path, str]]:
    """The files of INPUT, in order, each with how it is read (`"text"` or `"jsonl"`).

    Raises:
      FileNotFoundError: `path` does not exist.
      ValueError: a folder without a `*.txt` or `*.jsonl` file.
    """
    root = Path(path)
    if root.is_file():
        return [(root, "jsonl" if root.suffix in (".jsonl", ".json") else "text")]
    if not root.is_dir():
        raise FileNotFoundError(f"input {str(path)!r}: no such file or folder (expected a text "
                                "file, a folder of *.txt files or a JSON-lines file)")
    found = []
    for file in root.rglob("*"):
        rel = file.relative_to(root)
        if file.suffix in (".txt", ".jsonl") and file.is_file() and not any(
                part.startswith(".") for part in rel.parts):
            found.append((rel.parts, file, "jsonl" if file.suffix == ".jsonl" else "text"))
    if not found:
        raise ValueError(f"input folder {str(path)!r} holds no *.txt or *.jsonl file; "
                         "expected text files (one document each) or JSON lines")
    return [(file, kind) for _, file, kind in sorted(found)]


def _last_cut(s: str, lo: int) -> int:
    """The largest `p >= lo` with `s[p-2]` not whitespace, `s[p-1] == "\\n"` and `s[p]` not
    whitespace (0 when none). Python's `str.isspace` holds for every character the regex's
    `\\s` matches (Unicode White_Space) and a few more, so it only ever misses a cut."""
    start = max(lo - 1, 1)
    i = s.rfind("\n", start, len(s) - 1)
    while i >= start:
        if not s[i - 1].isspace() and not s[i + 1].isspace():
            return i + 1
        i = s.rfind("\n", start, i)
    return 0


def cut_pieces(blocks: Iterable[tuple[str, int]], rule: str
               ) -> Iterator[tuple[str, int, bool]]:
    """One document, given as consecutive blocks `(text, input_bytes)`, as pieces that
    encode to the document's ids when encoded one by one and concatenated.

    Args:
      blocks: the document's text in order, with the input bytes each block stands for.
      rule: `cut_rule(tokenizer)`.

    Returns:
      `(piece, input_bytes, last)` for each piece, a block's input bytes with the piece
      that holds its last character; the last piece (perhaps empty) has `last=True`. A
      piece ends where a block begins (`CUT_ANYWHERE`), at the last allowed cut of a block
      (`CUT_GPT2_NEWLINE`; a piece grows until a block has one), or never before the
      document's end (`CUT_NEVER`).

    Example:
      >>> list(cut_pieces([("ab\\nCd", 5), ("\\n\\nef", 4)], CUT_GPT2_NEWLINE))
      [('ab\\n', 0, False), ('Cd\\n\\nef', 9, True)]
    """
    if rule not in (CUT_ANYWHERE, CUT_GPT2_NEWLINE, CUT_NEVER):
        raise ValueError(f"rule={rule!r}: expected {CUT_ANYWHERE!r}, {CUT_GPT2_NEWLINE!r} or "
                         f"{CUT_NEVER!r}")
    pending: list[str] = []  # the text after the last cut
    tail = ""  # the document's last two characters so far (a cut looks one back)
    nbytes = 0  # the input bytes of the blocks that end in `pending`
    for block, n in blocks:
        if not block:  # (the end of a file) changes nothing but the byte count
            nbytes += n
            continue
        cut = None
        if rule == CUT_ANYWHERE:
            cut = 0
        elif rule == CUT_GPT2_NEWLINE:
            p = _last_cut(tail + block, len(tail))
            cut = p - len(tail) if p else None
        tail = (tail + block)[-2:]
        if cut is not None:
            piece = "".join([*pending, block[:cut]])
            pending = []
            if piece:
                yield piece, nbytes, False
                nbytes = 0
            block = block[cut:]
        pending.append(block)
        nbytes += n
    yield "".join(pending), nbytes, True


def _text_blocks(path: Path, block_bytes: int) -> Iterator[tuple[str, int]]:
    """A UTF-8 file's text, `block_bytes` of it at a time (a character never split)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(block_bytes)
            held = len(decoder.getstate()[0])
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as err:
                at = offset - held + err.start
                raise ValueError(f"{path}: not UTF-8 text (byte {at:,} cannot be decoded); "
                                 "expected UTF-8") from None
            offset += len(raw)
            yield text, len(raw)
            if not raw:
                return


def _jsonl_texts(path: Path) -> Iterator[tuple[str, int]]:
    """Each line's `text` with the line's bytes; blank lines skipped."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise ValueError(f"{path}:{number}: not a JSON line ({err}); expected one "
                                 'JSON object per line, e.g. {"text": "..."}') from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                got = (f"a {type(record).__name__}" if not isinstance(record, dict) else
                       f"keys {sorted(record)[:5]}" if "text" not in record else
                       f"text of type {type(text).__name__}")
                raise ValueError(f'{path}:{number}: expected a JSON object with a string "text" '
                                 f"field, got {got}")
            yield text, len(line)


def _documents(files: Sequence[tuple[Path, str]], rule: str, block_chars: int
               ) -> Iterator[Iterator[tuple[str, int]]]:
    """Each document as blocks `(text, input_bytes)` of about `block_chars` characters."""
    for path, kind in files:
        if kind == "text":
            yield _text_blocks(path, block_chars)
        else:
            for text, n in _jsonl_texts(path):
                if len(text) <= block_chars or rule == CUT_NEVER:
                    yield iter([(text, n)])
                else:
                    yield iter([(text[i:i + block_chars], n if i == 0 else 0)
                                for i in range(0, len(text), block_chars)])


@dataclasses.dataclass
class _Chunk:
    pieces: list[tuple[str, bool, bool]] = dataclasses.field(default_factory=list)
    chars: int = 0
    input_bytes: int = 0
    documents: int = 0


def _chunks(files: Sequence[tuple[Path, str]], rule: str, chunk_bytes: int
            ) -> Iterator[_Chunk]:
    """The input's pieces, grouped into chunks of about `chunk_bytes` characters."""
    chunk = _Chunk()
    for blocks in _documents(files, rule, chunk_bytes):
        chunk.documents += 1
        first = True
        for piece, nbytes, last in cut_pieces(blocks, rule):
            chunk.pieces.append((piece, first, last))
            chunk.chars += len(piece)
            chunk.input_bytes += nbytes
            first = False
            if chunk.chars >= chunk_bytes:
                yield chunk
                chunk = _Chunk()
    if chunk.pieces:
        yield chunk


def _pool_context() -> multiprocessing.context.BaseContext:
    """How workers start: `fork` on Linux while this process runs one thread (they start in
    milliseconds, without importing the trainer's packages again, and no lock of another
    thread is copied held); else `forkserver` (a clean process, started once per process,
    that has imported this module, forks them); else `spawn` (Windows)."""
    methods = multiprocessing.get_all_start_methods()
    if sys.platform == "linux" and "fork" in methods and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    if "forkserver" in methods:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["train.prepare"])
        return context
    return multiprocessing.get_context("spawn")


def _encoded(chunks: Iterator[_Chunk], encoder: _Encoder, pool: Any, workers: int
             ) -> Iterator[tuple[np.ndarray, _Chunk]]:
    """Each chunk's ids, in input order: in this process without a `pool`, else with at
    most `2 * workers` chunks in flight (a pool's `imap` would read the whole input ahead
    into memory)."""
    if pool is None:
        for chunk in chunks:
            yield encoder(chunk.pieces), chunk
        return
    in_flight: collections.deque = collections.deque()
    for chunk in chunks:
        in_flight.append((pool.apply_async(_encode_in_worker, (chunk.pieces,)), chunk))
        if len(in_flight) >= 2 * workers:
            result, done = in_flight.popleft()
            yield result.get(), done
    while in_flight:
        result, done = in_flight.popleft()
        yield result.get(), done


# --------------------------------------------------------------------------- output


def _output_files(out: Path) -> list[Path]:
    """The files of `out` that a dataset reader would take (and `--overwrite` removes)."""
    names = {DATASET_META, "tokenizer.json", "train.bin", "val.bin", _TMP}
    return sorted(p for p in out.iterdir() if p.is_file() and (
        p.name in names or (p.suffix in (".bin", ".part") and (
            "_train_" in p.name or "_val_" in p.name))))


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out={str(out)!r} is a file; expected a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"--out={str(out)!r} exists and is not empty; pass --overwrite to "
                             "replace the dataset in it, or choose a new folder")
        for path in _output_files(out):  # only dataset files: nothing else is deleted
            path.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _write_split(stream: np.ndarray, out: Path, fmt: str, name: str, split: str,
                 shard_tokens: int) -> list[Path]:
    if fmt == "nanogpt":
        path = out / f"{split}.bin"
        with open(path, "wb") as f:
            for a in range(0, stream.size, shard_tokens):
                stream[a:a + shard_tokens].tofile(f)
        return [path]
    return [write_shard(out / f"{name}_{split}_{k:06d}.bin", stream[a:a + shard_tokens])
            for k, a in enumerate(range(0, stream.size, shard_tokens))]


def prepare(input: str | os.PathLike, out: str | os.PathLike, *,
            tokenizer: str | Tokenizer = "gpt2", eot: str | None = None,
            format: str = "shards", val_fraction: float | None = None,
            val_tokens: int | None = None, shard_tokens: int = 100_000_000,
            workers: int | None = None, name: str = "tokens", overwrite: bool = False,
            progress: bool = False, chunk_bytes: int = CHUNK_BYTES) -> Prepared:
    """Tokenize `input` into the dataset folder `out` (the module's docstring says how).

    Args:
      input: a text file, a folder of `*.txt`/`*.jsonl` files, or a JSON-lines file.
      out: the dataset folder (created; an existing non-empty one needs `overwrite`).
      tokenizer: `"gpt2"`, `"bytes"`, the path of a `tokenizer.json`, or a `Tokenizer`.
      eot: a `tokenizer.json`'s end-of-text token.
      format: `"shards"` (modded-nanogpt's) or `"nanogpt"` (`train.bin`, `val.bin`).
      val_fraction: the last fraction of the tokens that is val (default 0.1).
      val_tokens: instead, the number of val tokens at the end.
      shard_tokens: at most this many tokens per shard.
      workers: tokenizing processes (default `os.cpu_count()`).
      name: the shards' prefix.
      overwrite: replace the dataset files of an existing `out` (and only those).
      progress: show a progress bar over the input's bytes.
      chunk_bytes: text per chunk sent to a worker (the output does not depend on it).

    Returns:
      A `Prepared` record (its `summary()` is the command line's last line).

    Raises:
      ValueError, OSError: a bad option or input, in one line naming it.
    """
    started = time.perf_counter()
    if format not in FORMATS:
        raise ValueError(f"--format={format!r}: expected one of {', '.join(FORMATS)}")
    if val_fraction is not None and val_tokens is not None:
        raise ValueError("--val_fraction and --val_tokens: expected one of them, not both")
    if val_tokens is None:
        val_fraction = 0.1 if val_fraction is None else val_fraction
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"--val_fraction={val_fraction}: expected a value in (0, 1)")
    elif val_tokens < 1:
        raise ValueError(f"--val_tokens={val_tokens}: expected a positive count")
    if not 1 <= shard_tokens < 2**31:
        raise ValueError(f"--shard_tokens={shard_tokens}: expected 1 .. {2**31 - 1}")
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise ValueError(f"--workers={workers}: expected at least 1")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes}: expected at least 1")
    if not _NAME.fullmatch(name) or "_val_" in f"{name}_train_" or "_train_" in f"{name}_val_":
        raise ValueError(f"--name={name!r}: expected letters, digits, '.', '-' and '_' between "
                         "them, without _train or _val in it (they name the shards' split)")
    files = input_files(input)
    tok, tokenizer_json = _load_tokenizer(tokenizer, eot)
    out = Path(out)
    new_folders = [f for f in (out, *out.parents) if not f.exists()]  # made here, deepest first
    _prepare_out(out, overwrite)
    try:
        written, documents, n_train, n = _write_dataset(
            files, tok, tokenizer_json, out, format=format, val_fraction=val_fraction,
            val_tokens=val_tokens, shard_tokens=shard_tokens, workers=workers, name=name,
            progress=progress, chunk_bytes=chunk_bytes, source=Path(input).absolute(),
            input_name=str(input))
    except BaseException:  # a bad input found while reading: leave no half dataset behind
        for path in _output_files(out):
            path.unlink(missing_ok=True)
        for folder in new_folders:
            with contextlib.suppress(OSError):  # kept if something else appeared in it
                folder.rmdir()
        raise
    total_bytes = sum(path.stat().st_size for path, _ in files)
    return Prepared(out, written, documents, n_train, n - n_train, total_bytes,
                    time.perf_counter() - started)


def _write_dataset(files: Sequence[tuple[Path, str]], tok: Tokenizer,
                   tokenizer_json: bytes | None, out: Path, *, format: str,
                   val_fraction: float | None, val_tokens: int | None, shard_tokens: int,
                   workers: int, name: str, progress: bool, chunk_bytes: int, source: Path,
                   input_name: str) -> tuple[dict[str, list[Path]], int, int, int]:
    """Tokenize `files` into `out` (the split files, `tokenizer.json`, `dataset.json`).

    Returns:
      `(written, documents, train_tokens, tokens)`.
    """
    before = format == "shards"
    rule = cut_rule(tok)
    total_bytes = sum(path.stat().st_size for path, _ in files)
    tmp = out / _TMP
    documents = 0
    try:
        encoder = _Encoder(tok, before)
        with contextlib.ExitStack() as stack:
            stream_file = stack.enter_context(open(tmp, "wb"))
            pool = None if workers == 1 else stack.enter_context(  # before the bar's thread
                _pool_context().Pool(workers, _init_worker, (encoder,)))
            bar = stack.enter_context(_progress_bar(total_bytes, progress))
            for ids, chunk in _encoded(_chunks(files, rule, chunk_bytes), encoder, pool,
                                       workers):
                ids.tofile(stream_file)
                documents += chunk.documents
                bar.update(chunk.input_bytes)
        n = tmp.stat().st_size // 2
        n_train = n - val_tokens if val_tokens is not None else int(n * (1.0 - val_fraction))
        if not 0 < n_train < n:
            split = (f"--val_tokens={val_tokens}" if val_tokens is not None
                     else f"--val_fraction={val_fraction}")
            raise ValueError(f"input {input_name!r} gives {n:,} tokens: too few for a train "
                             f"and a val split with {split}; expected more text or a smaller "
                             "val split")
        stream = np.memmap(tmp, np.uint16, "r", shape=(n,)) if n else np.zeros(0, np.uint16)
        written = {split: _write_split(part, out, format, name, split, shard_tokens)
                   for split, part in (("train", stream[:n_train]), ("val", stream[n_train:]))}
        del stream
    finally:
        tmp.unlink(missing_ok=True)

    meta: dict[str, Any] = tok.to_meta()
    if tokenizer_json is not None:
        (out / "tokenizer.json").write_bytes(tokenizer_json)
        meta = {**meta, "file": "tokenizer.json"}
    dataset = {"layout": format, "vocab_size": tok.vocab_size, "tokenizer": meta,
               "eot_id": tok.eot_id, "eot_position": "before" if before else "after",
               "documents": documents, "train_tokens": n_train, "val_tokens": n - n_train,
               "source": str(source), "format_version": 1}
    (out / DATASET_META).write_text(json.dumps(dataset, indent=2) + "\n")
    return written, documents, n_train, n


def _progress_bar(total: int, enabled: bool) -> Any:
    """A tqdm bar over the input's bytes (a context manager), or a stand-in that shows
    nothing (a disabled tqdm bar still starts tqdm's monitor thread)."""
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", smoothing=0.1)


class _NoBar:
    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: int) -> None:
        pass


# ------------------------------------------------------------------------------ CLI


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m train.prepare`; prints one summary line."""
    parser = argparse.ArgumentParser(prog="python -m train.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="a text file, a folder of *.txt/*.jsonl, or a .jsonl file")
    parser.add_argument("--out", required=True, help="the dataset folder to write")
    parser.add_argument("--tokenizer", default="gpt2",
                        help="gpt2 (default), bytes, or the path of a tokenizer.json")
    parser.add_argument("--eot", default=None,
                        help="a tokenizer.json's end-of-text token (default: found by name)")
    parser.add_argument("--format", default="shards", choices=FORMATS,
                        help="shards (modded-nanogpt's, default) or nanogpt (train/val.bin)")
    val = parser.add_mutually_exclusive_group()
    val.add_argument("--val_fraction", type=float, default=None,
                     help="the last fraction of the tokens is val (default 0.1)")
    val.add_argument("--val_tokens", type=int, default=None, help="the last N tokens are val")
    parser.add_argument("--shard_tokens", type=int, default=100_000_000,
                        help="at most this many tokens per shard (default 1e8)")
    parser.add_argument("--workers", type=int, default=None,
                        help="tokenizing processes (default: os.cpu_count())")
    parser.add_argument("--name", default="tokens", help="the shards' prefix (default tokens)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the dataset files of an existing --out (only those)")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    return run_cli(lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    result = prepare(args.input, args.out, tokenizer=args.tokenizer, eot=args.eot,
                     format=args.format, val_fraction=args.val_fraction,
                     val_tokens=args.val_tokens, shard_tokens=args.shard_tokens,
                     workers=args.workers, name=args.name, overwrite=args.overwrite,
                     progress=not args.no_progress and sys.stderr.isatty())
    print(result.summary())
    return 0


if __name__ == "__main__":
    # Run the module's importable copy, so that workers started by spawn or a forkserver
    # find its functions as `train.prepare.*` rather than in this `__main__`.
    from train.prepare import main as _main

    sys.exit(_main())
