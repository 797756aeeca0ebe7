"""Character-level data: the corpus, its vocabulary, a 90/10 split and random windows.

The tiny-shakespeare corpus ships with the repository (`data/tinyshakespeare/input.txt`,
its origin and checksums in `SOURCE`), found relative to this file, so training works
offline from any directory; `--data=PATH` trains on another text file.

Batches are a pure function of `(seed, step)`, like nanoGPT's random offsets but with a
seeded generator, so a resumed run draws exactly the batches the uninterrupted run drew;
there is no iterator state to save beyond the step.

Example:
  >>> data = CharDataset.from_text("hello world, hello jax" * 10)
  >>> x_ABT, y_ABT = data.batch("train", step=0, batch_size=2, block_size=8, seed=0)
  >>> x_ABT.shape, data.decode(data.encode("hello"))
  ((1, 2, 8), 'hello')

References:
  Karpathy, "char-rnn" (data/tinyshakespeare), https://github.com/karpathy/char-rnn, 2015.
  Karpathy, "nanoGPT" (data/shakespeare_char/prepare.py, train.py get_batch),
  https://github.com/karpathy/nanoGPT, 2023.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

__all__ = [
    "SHIPPED_CORPUS",
    "TINYSHAKESPEARE_SHA256",
    "TINYSHAKESPEARE_URL",
    "CharDataset",
    "corpus_search_paths",
    "find_corpus",
]

TINYSHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt")
TINYSHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHIPPED_CORPUS = Path(__file__).resolve().parents[1] / "data" / "tinyshakespeare" / "input.txt"
_SPLITS = {"train": 0, "val": 1}


def _cache_dir() -> Path:
    root = os.environ.get("OPTAX_SNOO_CACHE") or Path.home() / ".cache" / "optax_snoo"
    return Path(root) / "tinyshakespeare"


def corpus_search_paths() -> list[Path]:
    """Where the tiny-shakespeare corpus is looked for, in order, before downloading: the
    copy shipped in the repository, then the download cache (independent of the cwd)."""
    return [SHIPPED_CORPUS, _cache_dir() / "input.txt"]


def find_corpus(path: str | os.PathLike | None = None, *,
                search: Sequence[Path] | None = None,
                url: str = TINYSHAKESPEARE_URL, sha256: str = TINYSHAKESPEARE_SHA256,
                cache_dir: Path | None = None,
                opener: Callable = urllib.request.urlopen) -> Path:
    """Locate the corpus: `path`, then `search` (default `corpus_search_paths()`), then download.

    The download goes to `cache_dir` (default `$OPTAX_SNOO_CACHE/tinyshakespeare` or
    `~/.cache/optax_snoo/tinyshakespeare`) and is kept only if its sha256 matches.

    Args:
      path: an explicit text file (`--data`); it must exist.
      search: candidate files tried in order.
      url: where to download from when no candidate exists.
      sha256: expected hex digest of the download.
      cache_dir: where the download is stored.
      opener: `urllib.request.urlopen`-like callable (tests replace it).

    Returns:
      The path of a readable corpus file.

    Raises:
      FileNotFoundError: `path` is missing, or nothing was found and the download failed;
        the message says where to put the file.
    """
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"--data={str(path)!r}: no such file")
        return Path(path)
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


@dataclasses.dataclass(frozen=True, eq=False)
class CharDataset:
    """A character vocabulary and the encoded train/val splits (first 90% / last 10%)."""

    chars: str
    train_ids: np.ndarray
    val_ids: np.ndarray

    @classmethod
    def from_text(cls, text: str, val_fraction: float = 0.1) -> CharDataset:
        """Vocabulary = sorted distinct characters; the last `val_fraction` is validation."""
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction}: expected a value in (0, 1)")
        codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        uniq, ids = np.unique(codes, return_inverse=True)
        ids = ids.astype(np.uint16 if len(uniq) < 2**16 else np.int32)
        n_train = int(len(ids) * (1.0 - val_fraction))
        return cls("".join(map(chr, uniq)), ids[:n_train], ids[n_train:])

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> CharDataset:
        """Read the corpus found by `find_corpus(path)`."""
        return cls.from_text(find_corpus(path).read_text(encoding="utf-8"))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text`; characters outside the vocabulary raise ValueError."""
        stoi = {c: i for i, c in enumerate(self.chars)}
        missing = sorted(set(text) - stoi.keys())
        if missing:
            raise ValueError(f"characters {missing!r} are not in the vocabulary")
        return np.array([stoi[c] for c in text], np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of `ids`; ids beyond the vocabulary (padding) are dropped."""
        return "".join(self.chars[i] for i in np.asarray(ids).tolist() if 0 <= i < len(self.chars))

    def _windows(self, split: str, rng: np.random.Generator, n: int, batch_size: int,
                 block_size: int, rows: slice | None):
        """`(n, batch_size)` window starts drawn; only the windows of `rows` are gathered."""
        ids = self.split_ids(split)
        if len(ids) <= block_size:
            raise ValueError(f"{split} split has {len(ids)} tokens; block_size={block_size} "
                             "needs more")
        start = rng.integers(0, len(ids) - block_size, size=n * batch_size)
        start = start.reshape(n, batch_size)[:, slice(None) if rows is None else rows]
        window = ids[start[..., None] + np.arange(block_size + 1)].astype(np.int32)
        return window[..., :-1], window[..., 1:]

    def batch(self, split: str, step: int, *, batch_size: int, block_size: int,
              grad_accum: int = 1, seed: int = 0,
              rows: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Random windows for optimizer step `step`, a function of `(seed, split, step)` only.

        Args:
          rows: only these rows of the batch axis (a process's slice of the global batch,
            `train.sharding.process_rows`); the same values as slicing the whole batch.

        Returns:
          `(inputs, targets)`, int32 arrays of shape `(grad_accum, batch_size, block_size)`
          (`batch_size` cut to `rows`); targets are the inputs shifted by one. Micro-batch
          `a` holds windows `a*batch_size ... (a+1)*batch_size - 1` of the
          `grad_accum*batch_size` drawn, so `grad_accum=2, batch_size=b` reshapes
          `grad_accum=1, batch_size=2b`.
        """
        self.check_split(split)
        rng = np.random.default_rng([seed, _SPLITS[split], step])
        return self._windows(split, rng, grad_accum, batch_size, block_size, rows)

    def eval_batches(self, split: str, *, num_batches: int, batch_size: int, block_size: int,
                     seed: int = 0, rows: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The evaluation windows of `split`: the same at every evaluation of a run.

        Returns:
          `(inputs, targets)` of shape `(num_batches, batch_size, block_size)` (`batch_size`
          cut to `rows`, as in `batch`).
        """
        self.check_split(split)
        rng = np.random.default_rng([seed, 2 + _SPLITS[split]])
        return self._windows(split, rng, num_batches, batch_size, block_size, rows)

    def split_ids(self, split: str) -> np.ndarray:
        """The token ids of `split` ("train" or "val"); another name raises ValueError."""
        self.check_split(split)
        return self.train_ids if split == "train" else self.val_ids

    @staticmethod
    def check_split(split: str) -> None:
        """ValueError unless `split` is "train" or "val"."""
        if split not in _SPLITS:
            raise ValueError(f"split={split!r}: expected 'train' or 'val'")
