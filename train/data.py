"""Training data: a text file's characters, or token shards read lazily from disk.

`open_dataset(path)` recognises, from the path and the files' headers:

- a text file: its characters, the vocabulary sorted, the first 90% train and the last 10%
  val (nanoGPT's `shakespeare_char`); the default corpus, tiny shakespeare, ships with the
  repository (`data/tinyshakespeare/input.txt`), found relative to this file, so training
  works offline from any directory;
- nanoGPT's layout: a folder with `train.bin` and `val.bin` (uint16 ids, no header) and,
  where nanoGPT's character recipes write one, `meta.pkl` (`vocab_size`, `itos`, `stoi`);
  without it the ids are GPT-2's (50,257);
- modded-nanogpt's shards: a folder or glob of `*_train_*.bin` / `*_val_*.bin`, each 256
  int32 of header (magic 20240520, version 1, token count) then uint16 ids; GPT-2's ids;
- a folder written by `python -m train.prepare`: such shards (or nanoGPT's two files)
  and `dataset.json` naming the tokenizer and the vocabulary size.

Token files are never read whole: each batch maps the shards it needs with `np.memmap`,
copies its windows and unmaps them again (nanoGPT re-creates its memmap every batch for
the same reason: pages a long-lived map has touched stay in the process's resident set),
so the process's memory does not grow with the dataset or the run's length. Every file's
header and size are checked when the dataset opens, and its ids against the vocabulary:
all of them for up to `FULL_SCAN_TOKENS` tokens in all, else each shard's first and last
`SCAN_CHUNK_TOKENS`; every batch is checked again as it is read. A bad file gets one
line naming it and what was expected (`ValueError`), before anything compiles.

Batches are a pure function of `(seed, split, step)`: window starts drawn uniformly over
every window of the split that lies inside one file, with a seeded generator (nanoGPT's
random offsets), so a resumed run draws exactly the batches the uninterrupted one drew,
whatever the number of shards. A process reads only the rows of the global batch its
devices hold (`rows=`).

`sequential_batch` is the other data order (`--data_order=sequential`), modded-nanogpt's
`distributed_data_generator` (records/track_3_optimization/train_gpt_simple.py): the
shards in sorted order, each step the next contiguous `grad_accum * batch_size *
block_size + 1` ids, inputs and targets that stream shifted by one and cut into rows of
`block_size` (no document alignment), a shard's remainder dropped when the next step would
not fit (`pos + tokens + 1 >= length`, the file's test). It too is a pure function of the
step: `sequential_position` finds a step's shard and offset by arithmetic, not by replay.

Example:
  >>> data = TokenDataset.from_text("hello world, hello jax" * 10)
  >>> x_ABT, y_ABT = data.batch("train", step=0, batch_size=2, block_size=8, seed=0)
  >>> x_ABT.shape, data.tokenizer.decode(data.tokenizer.encode("hello"))
  ((1, 2, 8), 'hello')

References:
  Karpathy, "char-rnn" (data/tinyshakespeare), https://github.com/karpathy/char-rnn, 2015.
  Karpathy, "nanoGPT" (data/shakespeare_char/prepare.py, data/openwebtext/prepare.py,
  train.py get_batch), https://github.com/karpathy/nanoGPT, 2023.
  Jordan et al., "modded-nanogpt" (data/fineweb.py, train_gpt.py _load_data_shard),
  https://github.com/KellerJordan/modded-nanogpt, 2024.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import hashlib
import io
import json
import os
import pickle
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from train.tokenizer import CharTokenizer, Tokenizer, from_meta

__all__ = [
    "DATASET_META",
    "FULL_SCAN_TOKENS",
    "GPT2_VOCAB_SIZE",
    "SHARD_HEADER_INTS",
    "SHARD_MAGIC",
    "SHARD_VERSION",
    "SHIPPED_CORPUS",
    "TINYSHAKESPEARE_SHA256",
    "TINYSHAKESPEARE_URL",
    "BatchPrefetcher",
    "Shard",
    "TokenDataset",
    "TokenSplit",
    "check_split",
    "corpus_search_paths",
    "find_corpus",
    "load_meta_pkl",
    "open_dataset",
    "read_shard_header",
    "sequential_position",
    "sequential_steps_per_shard",
    "write_shard",
]

TINYSHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt")
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHIPPED_CORPUS = Path(__file__).resolve().parents[1] / "data" / "tinyshakespeare" / "input.txt"
#: modded-nanogpt's shard header: 256 int32, [magic, version, token count, 0...].
SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256
#: The metadata file of a folder written by `python -m train.prepare`.
DATASET_META = "dataset.json"
#: GPT-2's vocabulary (tiktoken `gpt2`), the ids of nanoGPT's and modded-nanogpt's data.
GPT2_VOCAB_SIZE = 50257
#: Datasets up to this many tokens have every id checked when they open (2 GiB of uint16,
#: cheap next to a run: benchmarks/README.md, "Data loader"); larger ones are sampled.
FULL_SCAN_TOKENS = 2**30
SCAN_CHUNK_TOKENS = 2**22  # 8 MiB read at a time
_SPLITS = {"train": 0, "val": 1}
_GPT2_META = {"kind": "tiktoken", "name": "gpt2"}


def check_split(split: str) -> None:
    """ValueError unless `split` is "train" or "val"."""
    if split not in _SPLITS:
        raise ValueError(f"split={split!r}: expected 'train' or 'val'")


# ------------------------------------------------------------------ the shipped corpus


def _cache_dir() -> Path:
    root = os.environ.get("OPTAX_SNOO_CACHE") or Path.home() / ".cache" / "optax_snoo"
    return Path(root) / "tinyshakespeare"


def corpus_search_paths() -> list[Path]:
    """Where the tiny-shakespeare corpus is looked for, in order, before downloading: the
    copy shipped in the repository, then the download cache (independent of the cwd)."""
    return [SHIPPED_CORPUS, _cache_dir() / "input.txt"]


def find_corpus(search: Sequence[Path] | None = None, *, url: str = TINYSHAKESPEARE_URL,
                sha256: str = TINYSHAKESPEARE_SHA256, cache_dir: Path | None = None,
                opener: Callable = urllib.request.urlopen) -> Path:
    """Locate the default corpus: `search` (default `corpus_search_paths()`), then download.

    The download goes to `cache_dir` (default `$OPTAX_SNOO_CACHE/tinyshakespeare` or
    `~/.cache/optax_snoo/tinyshakespeare`) and is kept only if its sha256 matches.

    Args:
      search: candidate files tried in order.
      url: where to download from when no candidate exists.
      sha256: expected hex digest of the download.
      cache_dir: where the download is stored.
      opener: `urllib.request.urlopen`-like callable (tests replace it).

    Returns:
      The path of a readable corpus file.

    Raises:
      FileNotFoundError: nothing was found and the download failed; the message says where
        to put the file.
    """
    candidates = list(corpus_search_paths() if search is None else search)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    target_dir = Path(cache_dir) if cache_dir is not None else _cache_dir()
    target = target_dir / "input.txt"
    try:
        with opener(url, timeout=30) as response:
            payload = response.read()
    except (urllib.error.URLError, OSError, ValueError) as err:
        where = "\n  ".join(dict.fromkeys(str(c) for c in [*candidates, target]))
        raise FileNotFoundError(
            f"tiny shakespeare corpus not found and the download from {url} failed ({err}). "
            f"Put input.txt (sha256 {sha256}) at one of:\n  {where}\nor pass --data=PATH."
        ) from None
    digest = hashlib.sha256(payload).hexdigest()
    if digest != sha256:
        raise FileNotFoundError(f"downloaded corpus from {url} has sha256 {digest}, expected "
                                f"{sha256}; not saved. Put the file at {target} or pass --data.")
    target_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    tmp.write_bytes(payload)
    tmp.replace(target)
    return target


# ------------------------------------------------------------------------ file formats


def write_shard(path: str | os.PathLike, tokens: np.ndarray | Sequence[int]) -> Path:
    """Write `tokens` as one modded-nanogpt shard (header, then uint16 ids), atomically.

    Raises:
      ValueError: an id outside [0, 65535], or more than 2**31 - 1 tokens.
    """
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError(f"{path}: token ids must fit uint16 (0..65535), got "
                         f"{tokens.min()}..{tokens.max()}")
    if tokens.size >= 2**31:
        raise ValueError(f"{path}: {tokens.size} tokens do not fit one shard's int32 count")
    header = np.zeros(SHARD_HEADER_INTS, np.int32)
    header[:3] = SHARD_MAGIC, SHARD_VERSION, tokens.size
    path = Path(path)
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(header.tobytes())
        np.ascontiguousarray(tokens, np.uint16).tofile(f)  # no copy of uint16 tokens
    part.replace(path)
    return path


def read_shard_header(path: str | os.PathLike) -> int:
    """The token count of the modded-nanogpt shard at `path`, its header and size checked.

    Raises:
      ValueError: a short file, a wrong magic number or version, or a size that is not
        the header's plus 2 bytes per token (the message names the file).
    """
    path = Path(path)
    size = path.stat().st_size
    header_bytes = SHARD_HEADER_INTS * 4
    if size < header_bytes:
        raise ValueError(f"{path}: {size} bytes, shorter than a shard's {header_bytes}-byte "
                         "header (modded-nanogpt format: 256 int32, then uint16 tokens)")
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(header_bytes), np.int32)
    if header[0] != SHARD_MAGIC:
        raise ValueError(f"{path}: magic number {header[0]}, expected {SHARD_MAGIC} "
                         "(a modded-nanogpt token shard)")
    if header[1] != SHARD_VERSION:
        raise ValueError(f"{path}: version {header[1]}, expected {SHARD_VERSION}")
    count = int(header[2])
    if size != header_bytes + 2 * count:
        raise ValueError(f"{path}: {size} bytes, expected {header_bytes + 2 * count} (header "
                         f"+ 2 bytes x {count} tokens, the count its header gives)")
    return count


class _DataOnlyUnpickler(pickle.Unpickler):
    """Admits only pickle's own containers and scalars: a class or function reference (how
    a crafted pickle runs code) is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: only dicts, lists, "
                                     "strings and numbers are allowed")


def load_meta_pkl(path: str | os.PathLike) -> dict[str, Any]:
    """nanoGPT's `meta.pkl` (`vocab_size`, `itos`, `stoi`), read without running code.

    Raises:
      ValueError: the file holds anything but dicts, lists, strings and numbers, or not a
        character vocabulary (the message names the file).
    """
    try:
        meta = _DataOnlyUnpickler(io.BytesIO(Path(path).read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as err:
        raise ValueError(f"{path}: not a nanoGPT meta.pkl of plain data ({err})") from None
    itos = meta.get("itos") if isinstance(meta, dict) else None
    if not isinstance(itos, dict) or not isinstance(meta.get("vocab_size"), int) or sorted(
            itos) != list(range(meta["vocab_size"])) or not all(
            isinstance(c, str) and len(c) == 1 for c in itos.values()):
        raise ValueError(f"{path}: expected nanoGPT's character vocabulary, a dict with "
                         "vocab_size and itos (ids 0..vocab_size-1 -> one character each)")
    return meta


# ---------------------------------------------------------------------------- splits


@dataclasses.dataclass(frozen=True)
class Shard:
    """One file's tokens (`path` at byte `offset`, `length` uint16 ids), or an in-memory
    array (`array`, for a text file's characters)."""

    path: Path | None
    offset: int
    length: int
    array: np.ndarray | None = None

    def open(self) -> np.ndarray:
        """The ids: the array, or a fresh read-only memmap (dropped by the caller)."""
        if self.array is not None:
            return self.array
        return np.memmap(self.path, np.uint16, "r", offset=self.offset, shape=(self.length,))

    @property
    def name(self) -> str:
        return "the text" if self.path is None else str(self.path)


@dataclasses.dataclass(frozen=True)
class TokenSplit:
    """A split's shards, in order; windows never straddle two of them."""

    shards: tuple[Shard, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.shards)

    def starts(self, block_size: int) -> np.ndarray:
        """Windows per shard: `length - block_size` starts (a window reads `block_size + 1`
        ids, its inputs and its targets shifted by one)."""
        return np.array([max(s.length - block_size, 0) for s in self.shards], np.int64)

    def draw(self, rng: np.random.Generator, size: int, block_size: int
             ) -> tuple[np.ndarray, np.ndarray]:
        """`size` window starts drawn uniformly over every window: `(shard, offset)` arrays."""
        counts = self.starts(block_size)
        ends = np.cumsum(counts)
        if not ends.size or ends[-1] == 0:
            longest = max((s.length for s in self.shards), default=0)
            raise ValueError(f"no window of block_size={block_size} fits: the longest file of "
                             f"the split holds {longest} tokens (a window needs "
                             f"block_size + 1)")
        flat = rng.integers(0, ends[-1], size=size)
        shard = np.searchsorted(ends, flat, side="right")
        return shard, flat - (ends[shard] - counts[shard])

    def read(self, shard: np.ndarray, offset: np.ndarray, length: int,
             vocab_size: int) -> np.ndarray:
        """The windows `ids[offset : offset + length]` of each `(shard, offset)`, int32,
        shaped like `offset` plus `(length,)`; each shard mapped once, then released.

        Raises:
          ValueError: an id >= `vocab_size` (naming the file and the position).
        """
        out = np.empty((offset.size, length), np.int32)
        flat_shard, flat_offset = shard.ravel(), offset.ravel()
        for i in np.unique(flat_shard):
            ids = self.shards[i].open()
            for row in np.flatnonzero(flat_shard == i):
                out[row] = ids[flat_offset[row]:flat_offset[row] + length]
            del ids  # unmaps the file: its pages leave the resident set
        if out.size and out.max() >= vocab_size:
            row = int(np.argmax(out.max(axis=1)))
            s = self.shards[flat_shard[row]]
            bad = int(out[row].max())
            at = int(flat_offset[row] + np.argmax(out[row]))
            raise ValueError(f"{s.name}: token id {bad} at token {at}, expected ids below the "
                             f"vocabulary size {vocab_size}")
        return out.reshape(*offset.shape, length)


def sequential_steps_per_shard(length: int, step_tokens: int, *, first: bool = False) -> int:
    """Steps the sequential order takes from a shard of `length` ids, `step_tokens` each.

    modded-nanogpt's generator tests `pos + step_tokens + 1 >= length` before each step and
    then opens the next shard, which it reads at `pos = 0` without testing again. So the
    first shard gives the steps `k` with `k * step_tokens + step_tokens + 1 < length`,
    `(length - 2) // step_tokens`; every later shard its step at 0 too: `max(1, ...)`, for
    a shard of at least `step_tokens + 1` ids. A shorter later shard gives 0 steps (skipped
    whole; the file would read a short buffer there and fail).

    Example:
      >>> sequential_steps_per_shard(10, 4), sequential_steps_per_shard(9, 4)
      (2, 1)
      >>> sequential_steps_per_shard(5, 4, first=True), sequential_steps_per_shard(5, 4)
      (0, 1)
    """
    if step_tokens < 1:
        raise ValueError(f"step_tokens={step_tokens}: expected >= 1")
    tested = max(0, (length - 2) // step_tokens)
    if first or length < step_tokens + 1:
        return tested
    return max(1, tested)


def sequential_position(lengths: Sequence[int], step: int, step_tokens: int
                        ) -> tuple[int, int]:
    """`(shard, pos)`: where the sequential order reads step `step` (>= 0), without replay.

    Raises:
      ValueError: a negative step, or a step beyond the last shard (naming how many steps
        the shards hold).
    """
    if step < 0:
        raise ValueError(f"step={step}: expected >= 0")
    per_shard = np.array([sequential_steps_per_shard(n, step_tokens, first=i == 0)
                          for i, n in enumerate(lengths)], np.int64)
    ends = np.cumsum(per_shard)
    total = int(ends[-1]) if ends.size else 0
    if step >= total:
        raise ValueError(f"step {step}: the sequential data order holds {total} steps of "
                         f"{step_tokens:,} tokens in these {len(lengths)} file(s) (a file of "
                         "length n reads (n - 2) // tokens steps); train fewer steps or use "
                         "more data")
    shard = int(np.searchsorted(ends, step, side="right"))
    return shard, int(step - (ends[shard] - per_shard[shard])) * step_tokens


# ---------------------------------------------------------------------------- dataset


@dataclasses.dataclass(frozen=True, eq=False)
class TokenDataset:
    """A tokenized corpus: the train and val splits, the vocabulary and how to decode it.

    Attributes:
      splits: `{"train": TokenSplit, "val": TokenSplit}`.
      vocab_size: the ids' range (before any padding of the model's vocabulary).
      tokenizer_meta: the tokenizer's `to_meta()` (`tokenizer` builds it on first use, so
        training on GPT-2 ids needs no tiktoken; only sampling does).
      source: what was recognised, for the start-up line.
      root: where a relative `tokenizer.json` of `tokenizer_meta` lies.
    """

    splits: Mapping[str, TokenSplit]
    vocab_size: int
    tokenizer_meta: Mapping[str, Any]
    source: str
    root: Path | None = None

    @classmethod
    def from_text(cls, text: str, val_fraction: float = 0.1, source: str = "text"
                  ) -> TokenDataset:
        """Vocabulary = sorted distinct characters; the last `val_fraction` is validation."""
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction}: expected a value in (0, 1)")
        codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        uniq, ids = np.unique(codes, return_inverse=True)
        ids = ids.astype(np.uint16 if len(uniq) <= 2**16 else np.int32)
        n_train = int(len(ids) * (1.0 - val_fraction))
        split = lambda a: TokenSplit((Shard(None, 0, len(a), a),))
        tokenizer = CharTokenizer("".join(map(chr, uniq)))
        return cls({"train": split(ids[:n_train]), "val": split(ids[n_train:])},
                   tokenizer.vocab_size, tokenizer.to_meta(), source)

    @property
    def tokenizer(self) -> Tokenizer:
        """The dataset's tokenizer (built on first use; GPT-2's needs tiktoken)."""
        if "_tokenizer" not in self.__dict__:
            object.__setattr__(self, "_tokenizer", from_meta(self.tokenizer_meta, self.root))
        return self.__dict__["_tokenizer"]

    def split(self, split: str) -> TokenSplit:
        check_split(split)
        return self.splits[split]

    def num_tokens(self, split: str) -> int:
        return self.split(split).num_tokens

    def describe(self) -> str:
        """One line: what was recognised, the tokens per split and the vocabulary."""
        return (f"{self.source}: {self.num_tokens('train'):,} train / "
                f"{self.num_tokens('val'):,} val tokens, vocabulary {self.vocab_size:,}")

    def _windows(self, split: str, rng: np.random.Generator, n: int, batch_size: int,
                 block_size: int, rows: slice | None):
        """`(n, batch_size)` window starts drawn; only the windows of `rows` are read."""
        shard, offset = self.split(split).draw(rng, n * batch_size, block_size)
        keep = (slice(None), slice(None) if rows is None else rows)
        shard, offset = shard.reshape(n, batch_size)[keep], offset.reshape(n, batch_size)[keep]
        window = self.splits[split].read(shard, offset, block_size + 1, self.vocab_size)
        return window[..., :-1], window[..., 1:]

    def batch(self, split: str, step: int, *, batch_size: int, block_size: int,
              grad_accum: int = 1, seed: int = 0,
              rows: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Random windows for optimizer step `step`, a function of `(seed, split, step)` only.

        Args:
          rows: only these rows of the batch axis (a process's slice of the global batch,
            `train.sharding.process_rows`); the same values as slicing the whole batch,
            and only they are read.

        Returns:
          `(inputs, targets)`, int32 arrays of shape `(grad_accum, batch_size, block_size)`
          (`batch_size` cut to `rows`); targets are the inputs shifted by one. Micro-batch
          `a` holds windows `a*batch_size ... (a+1)*batch_size - 1` of the
          `grad_accum*batch_size` drawn, so `grad_accum=2, batch_size=b` reshapes
          `grad_accum=1, batch_size=2b`.
        """
        check_split(split)
        rng = np.random.default_rng([seed, _SPLITS[split], step])
        return self._windows(split, rng, grad_accum, batch_size, block_size, rows)

    def sequential_batch(self, split: str, step: int, *, batch_size: int, block_size: int,
                         grad_accum: int = 1, rows: slice | None = None
                         ) -> tuple[np.ndarray, np.ndarray]:
        """The contiguous tokens of step `step` in the sequential order (module docstring).

        The step's `A * B * T + 1` ids from `(shard, pos) = sequential_position(...)` form
        `A * B` rows of `T`: row `i` is inputs `ids[pos + i*T : pos + i*T + T]`, targets one
        further. Micro-batch `a` holds rows `a*B ... a*B + B - 1` (the step's chunk split
        in order, as the file splits a rank's rows into micro-batches), so `grad_accum=2,
        batch_size=b` reshapes `grad_accum=1, batch_size=2b`. With `rows` only those rows
        of each micro-batch are read: with `grad_accum=1`, rows `lo:hi` start at `pos +
        lo*T`, the file's rank offset `pos + rank * local_batch`.

        Returns:
          `(inputs, targets)`, int32 `(grad_accum, batch_size, block_size)` (`batch_size`
          cut to `rows`).
        """
        check_split(split)
        split_ = self.splits[split]
        step_tokens = grad_accum * batch_size * block_size
        shard, pos = sequential_position([s.length for s in split_.shards], step, step_tokens)
        lo, hi, _ = (rows or slice(None)).indices(batch_size)
        n = hi - lo
        starts = (pos + (np.arange(grad_accum)[:, None] * batch_size + lo
                         + np.arange(n)[None, :]) * block_size)
        window = split_.read(np.full(starts.shape, shard), starts, block_size + 1,
                             self.vocab_size)
        return window[..., :-1], window[..., 1:]

    def first_windows(self, split: str, *, num_tokens: int, batch_size: int, block_size: int,
                      rows: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The split's first `num_tokens // block_size` contiguous windows (those of
        `sequential_windows(max_tokens=num_tokens)`) as evaluation batches: modded-nanogpt's
        validation set (its first `val_tokens` ids, the same every evaluation).

        Returns:
          `(inputs, targets)` int32 `(num_batches, batch_size, block_size)` (`batch_size`
          cut to `rows`).

        Raises:
          ValueError: fewer windows than asked, or a count `batch_size` does not divide.
        """
        windows = num_tokens // block_size
        if num_tokens < 1 or num_tokens % (batch_size * block_size):
            raise ValueError(f"val_tokens={num_tokens}: expected a multiple of batch_size x "
                             f"block_size = {batch_size * block_size} (whole evaluation "
                             "batches, as the file asserts)")
        keep = slice(None) if rows is None else rows
        xs, ys = [], []
        for x, y in self.sequential_windows(split, block_size, batch_size=batch_size,
                                            max_tokens=num_tokens):
            if len(x) < batch_size:
                break
            xs.append(x[keep])
            ys.append(y[keep])
        if len(xs) * batch_size < windows:
            raise ValueError(f"val_tokens={num_tokens}: the {split} split holds "
                             f"{len(xs) * batch_size * block_size:,} tokens of whole "
                             f"windows of {block_size}; expected at least {num_tokens:,}")
        return np.stack(xs), np.stack(ys)

    def eval_batches(self, split: str, *, num_batches: int, batch_size: int, block_size: int,
                     seed: int = 0, rows: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The evaluation windows of `split`: the same at every evaluation of a run.

        Returns:
          `(inputs, targets)` of shape `(num_batches, batch_size, block_size)` (`batch_size`
          cut to `rows`, as in `batch`).
        """
        check_split(split)
        rng = np.random.default_rng([seed, 2 + _SPLITS[split]])
        return self._windows(split, rng, num_batches, batch_size, block_size, rows)

    def sequential_windows(self, split: str, block_size: int, *, batch_size: int,
                           max_tokens: int | None = None
                           ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every non-overlapping window of `split` once, file by file, in batches.

        Each file's windows are `ids[i*T : i*T + T + 1]` for `i < (length - 1) // T`; with
        `max_tokens`, only the first `max_tokens // T` windows (`python -m train.evaluate
        --eval_tokens`). Yields `(inputs, targets)` int32 `(b, block_size)`, `b <=
        batch_size` (only the last batch is smaller).
        """
        check_split(split)
        limit = None if max_tokens is None else max_tokens // block_size
        split_ = self.splits[split]
        todo: list[tuple[int, int]] = []  # (shard, offset) of the pending batch
        for i, s in enumerate(split_.shards):
            for w in range((s.length - 1) // block_size):
                if limit is not None and limit <= 0:
                    break
                todo.append((i, w * block_size))
                limit = None if limit is None else limit - 1
                if len(todo) == batch_size:
                    yield self._read_windows(split_, todo, block_size)
                    todo = []
        if todo:
            yield self._read_windows(split_, todo, block_size)

    def _read_windows(self, split: TokenSplit, todo, block_size):
        shard, offset = (np.array(a, np.int64) for a in zip(*todo, strict=True))
        window = split.read(shard, offset, block_size + 1, self.vocab_size)
        return window[:, :-1], window[:, 1:]

    def check_tokens(self) -> None:
        """Every id below `vocab_size` (all ids up to `FULL_SCAN_TOKENS` in all, else each
        file's first and last `SCAN_CHUNK_TOKENS`), read in chunks.

        Raises:
          ValueError: naming the first file with an id out of range, the id and where.
        """
        shards = [s for split in self.splits.values() for s in split.shards]
        whole = sum(s.length for s in shards) <= FULL_SCAN_TOKENS
        for s in shards:
            if s.length == 0:
                continue
            if s.array is not None:
                chunks = [(0, s.length)]
            elif whole:
                chunks = [(a, min(a + SCAN_CHUNK_TOKENS, s.length))
                          for a in range(0, s.length, SCAN_CHUNK_TOKENS)]
            else:
                chunks = sorted({(0, min(SCAN_CHUNK_TOKENS, s.length)),
                                 (max(s.length - SCAN_CHUNK_TOKENS, 0), s.length)})
            for lo, hi in chunks:
                ids = _read_ids(s, lo, hi)
                top = int(ids.max())
                if top >= self.vocab_size:
                    raise ValueError(f"{s.name}: token id {top} at token "
                                     f"{lo + int(np.argmax(ids))}, expected ids below the "
                                     f"vocabulary size {self.vocab_size}")


def _read_ids(shard: Shard, lo: int, hi: int) -> np.ndarray:
    """Ids `lo:hi` of `shard` read into memory (a file read, not a map)."""
    if shard.array is not None:
        return np.asarray(shard.array[lo:hi])
    with open(shard.path, "rb") as f:
        f.seek(shard.offset + 2 * lo)
        return np.fromfile(f, np.uint16, hi - lo)


# ------------------------------------------------------------------------ recognising


def _raw_shard(path: Path) -> Shard:
    size = path.stat().st_size
    if size % 2:
        raise ValueError(f"{path}: {size} bytes, expected an even size (uint16 token ids, "
                         "nanoGPT's .bin format)")
    return Shard(path, 0, size // 2)


def _header_shard(path: Path) -> Shard:
    return Shard(path, SHARD_HEADER_INTS * 4, read_shard_header(path))


def _nonempty(splits: dict[str, TokenSplit], where: str) -> dict[str, TokenSplit]:
    for name, split in splits.items():
        if split.num_tokens == 0:
            files = ", ".join(s.name for s in split.shards) or "no file"
            raise ValueError(f"{where}: the {name} split is empty ({files}); expected tokens")
    return splits


def _shard_files(pattern_or_folder: Path | str) -> dict[str, list[Path]]:
    """modded-nanogpt shard files by split, sorted, from a folder or a glob."""
    text = str(pattern_or_folder)
    if Path(text).is_dir():
        text = str(Path(text) / "*.bin")
    files = sorted(Path(p) for p in glob.glob(text))
    return {split: [f for f in files if f"_{split}_" in f.name] for split in _SPLITS}


def _from_shards(files: dict[str, list[Path]], where: str, vocab_size: int,
                 tokenizer_meta: Mapping[str, Any], source: str, root: Path | None
                 ) -> TokenDataset:
    for split, paths in files.items():
        if not paths:
            raise ValueError(f"--data={where}: no {split} shard (expected files named "
                             f"*_{split}_*.bin, modded-nanogpt's layout)")
    splits = {split: TokenSplit(tuple(_header_shard(p) for p in paths))
              for split, paths in files.items()}
    return TokenDataset(_nonempty(splits, f"--data={where}"), vocab_size, tokenizer_meta,
                        source, root)


def _from_nanogpt(folder: Path, vocab_size: int | None = None,
                  tokenizer_meta: Mapping[str, Any] | None = None,
                  source: str = "nanoGPT folder") -> TokenDataset:
    splits = {split: TokenSplit((_raw_shard(folder / f"{split}.bin"),)) for split in _SPLITS}
    if tokenizer_meta is None:
        meta_pkl = folder / "meta.pkl"
        if meta_pkl.is_file():
            meta = load_meta_pkl(meta_pkl)
            itos = meta["itos"]
            tokenizer_meta = CharTokenizer("".join(itos[i] for i in range(len(itos)))).to_meta()
            vocab_size, source = meta["vocab_size"], f"{source} with meta.pkl"
        else:
            tokenizer_meta, vocab_size = _GPT2_META, GPT2_VOCAB_SIZE
            source = f"{source} (GPT-2 ids)"
    return TokenDataset(_nonempty(splits, f"--data={folder}"), vocab_size, tokenizer_meta,
                        source, folder)


def _from_prepared(folder: Path) -> TokenDataset:
    meta_path = folder / DATASET_META
    try:
        meta = json.loads(meta_path.read_text())
        layout, vocab_size, tokenizer = meta["layout"], int(meta["vocab_size"]), meta["tokenizer"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{meta_path}: expected the JSON `python -m train.prepare` writes "
                         f"(layout, vocab_size, tokenizer): {err}") from None
    source = f"prepared folder ({tokenizer.get('name', tokenizer.get('kind'))} tokens)"
    if layout == "nanogpt":
        return _from_nanogpt(folder, vocab_size, tokenizer, source)
    if layout == "shards":
        return _from_shards(_shard_files(folder), str(folder), vocab_size, tokenizer, source,
                            folder)
    raise ValueError(f"{meta_path}: layout {layout!r}, expected 'shards' or 'nanogpt'")


def open_dataset(path: str | os.PathLike | None = None, *, check: bool = True) -> TokenDataset:
    """The dataset at `path` (`--data`; `None`: the shipped tiny shakespeare), recognised
    as the module's docstring says, with its files' headers, sizes and ids checked.

    Raises:
      FileNotFoundError: nothing at `path`.
      ValueError: a path of no known layout, a bad header or size, an empty split, an id
        beyond the vocabulary, a text file that is not UTF-8 (each naming the file).
    """
    if path is None:
        corpus = find_corpus()
        return TokenDataset.from_text(corpus.read_text(encoding="utf-8"),
                                      source=f"text file {corpus.name}")
    where = Path(path)
    if where.is_dir():
        if (where / DATASET_META).is_file():
            data = _from_prepared(where)
        elif (where / "train.bin").is_file() and (where / "val.bin").is_file():
            data = _from_nanogpt(where)
        elif any(_shard_files(where).values()):
            data = _from_shards(_shard_files(where), str(where), GPT2_VOCAB_SIZE, _GPT2_META,
                                "modded-nanogpt shards (GPT-2 ids)", where)
        else:
            raise ValueError(f"--data={str(path)!r}: a folder without train.bin/val.bin "
                             f"(nanoGPT), *_train_*.bin/*_val_*.bin shards (modded-nanogpt) or "
                             f"{DATASET_META} (python -m train.prepare)")
    elif where.is_file():
        data = _from_file(where)
    elif glob.has_magic(str(path)):
        files = _shard_files(str(path))
        if not any(files.values()):
            raise FileNotFoundError(f"--data={str(path)!r}: no file matches")
        data = _from_shards(files, str(path), GPT2_VOCAB_SIZE, _GPT2_META,
                            "modded-nanogpt shards (GPT-2 ids)", None)
    else:
        hint = (": modded-nanogpt's data/cached_fineweb10B.py downloads FineWeb's GPT-2 shards "
                "(`python data/cached_fineweb10B.py 18` in its checkout: 18 train shards of "
                "100M tokens and the val shard, into data/fineweb10B/); pass that folder as "
                "--data" if "fineweb" in str(path).lower() else "")
        raise FileNotFoundError(f"--data={str(path)!r}: no such file or folder{hint}")
    if check:
        data.check_tokens()
    return data


def _from_file(path: Path) -> TokenDataset:
    """A single file: a text file; token files are refused with what to pass instead."""
    with open(path, "rb") as f:
        head = f.read(4)
    if len(head) == 4 and int(np.frombuffer(head, np.int32)[0]) == SHARD_MAGIC:
        raise ValueError(f"--data={str(path)!r} is one modded-nanogpt shard; pass its folder "
                         "or a glob of its *_train_*.bin and *_val_*.bin shards")
    if path.suffix == ".bin":
        raise ValueError(f"--data={str(path)!r} is a token file; pass the folder that holds "
                         "train.bin and val.bin (nanoGPT's layout)")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--data={str(path)!r} is not UTF-8 text (byte {err.start}: "
                         f"{raw[err.start:err.start + 1]!r}); expected a text file, a nanoGPT "
                         "folder, modded-nanogpt shards or a prepared folder") from None
    if len(text) < 2:
        raise ValueError(f"--data={str(path)!r}: {len(text)} characters; expected a corpus")
    return TokenDataset.from_text(text, source=f"text file {path.name}")


# ------------------------------------------------------------------------ prefetching


class BatchPrefetcher:
    """`get(step)` returns `make(step)`, computed in a background thread while the previous
    step ran: each call also starts `make(step + 1)` (batches are a function of the step,
    so a resumed or restarted loop asks for any step). An error in `make` raises at `get`.

    Example:
      >>> with BatchPrefetcher(lambda step: step * 2) as batches:
      ...     [batches.get(s) for s in range(3)]
      [0, 2, 4]
    """

    def __init__(self, make: Callable[[int], Any], enabled: bool = True):
        self.make, self.enabled = make, enabled
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "batches") if enabled else None
        self._pending: tuple[int, concurrent.futures.Future] | None = None

    def get(self, step: int) -> Any:
        if not self.enabled:
            return self.make(step)
        if self._pending is not None and self._pending[0] == step:
            batch = self._pending[1].result()
        else:
            batch = self.make(step)
        self._pending = (step + 1, self._pool.submit(self.make, step + 1))
        return batch

    def close(self) -> None:
        if self._pool is not None:
            if self._pending is not None:
                self._pending[1].cancel()
            self._pool.shutdown(wait=True)
            self._pending = None

    def __enter__(self) -> BatchPrefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
