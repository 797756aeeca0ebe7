"""Tokenizers of the trainer's datasets: characters, bytes, GPT-2's BPE, a `tokenizer.json`.

Each is a small object with `vocab_size`, `eot_id` (the end-of-text id written between
documents; `None` for a character vocabulary, which has none), `encode(text)`,
`decode(ids)` and `to_meta()`, a JSON-ready description that `from_meta` turns back into
the tokenizer: a checkpoint stores it, so `python -m train.sample` decodes without the
dataset. Ids at or beyond `vocab_size` (a padded vocabulary's extra rows) decode to
nothing.

- `CharTokenizer`: one id per character, the vocabulary sorted (nanoGPT's
  `shakespeare_char`); from a text or nanoGPT's `meta.pkl` (`stoi`/`itos`).
- `ByteTokenizer`: the 256 byte values, and id 256 for end-of-text; needs nothing.
- `TiktokenTokenizer`: OpenAI's `tiktoken`; `gpt2()` is GPT-2's encoding (50,257 ids,
  end-of-text 50256), downloaded by tiktoken on first use and cached in
  `$TIKTOKEN_CACHE_DIR` (default a folder in the system's temp dir).
- `HFTokenizer`: a Hugging Face `tokenizer.json` (the `tokenizers` package).

`tiktoken` and `tokenizers` come with the trainer's `data` extra
(`pip install -e ".[train,data]"`).

Example:
  >>> tok = ByteTokenizer()
  >>> tok.encode("hé"), tok.decode([104, 195, 169, 256, 1000])
  ([104, 195, 169], 'hé<|endoftext|>')
  >>> from_meta(tok.to_meta()).vocab_size
  257

References:
  Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2's byte-level
  BPE), OpenAI, 2019, https://cdn.openai.com/better-language-models/
  language_models_are_unsupervised_multitask_learners.pdf.
  OpenAI, "tiktoken", https://github.com/openai/tiktoken, 2022.
  Hugging Face, "tokenizers", https://github.com/huggingface/tokenizers, 2019.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "EOT_TEXT",
    "TOKENIZER_NAMES",
    "ByteTokenizer",
    "CharTokenizer",
    "HFTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "describe_meta",
    "from_meta",
    "get_tokenizer",
    "prompt_ids",
    "read_prompt",
]

#: How the end-of-text id reads when decoded (GPT-2's special token).
EOT_TEXT = "<|endoftext|>"
#: The names `get_tokenizer` (and `python -m train.prepare --tokenizer=`) knows; any other
#: value is the path of a `tokenizer.json`.
TOKENIZER_NAMES = ("gpt2", "bytes")


class Tokenizer:
    """The interface: `vocab_size`, `eot_id`, `encode`, `decode`, `to_meta`."""

    vocab_size: int
    eot_id: int | None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        raise NotImplementedError

    def to_meta(self) -> dict[str, Any]:
        raise NotImplementedError

    def _valid(self, ids: Sequence[int] | np.ndarray) -> list[int]:
        return [i for i in np.asarray(ids, np.int64).ravel().tolist() if 0 <= i < self.vocab_size]


@dataclasses.dataclass(frozen=True, eq=False)
class CharTokenizer(Tokenizer):
    """One id per character of `chars` (id i is `chars[i]`)."""

    chars: str
    eot_id = None

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The sorted distinct characters of `text`."""
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; characters outside the vocabulary raise ValueError."""
        stoi = {c: i for i, c in enumerate(self.chars)}
        missing = sorted(set(text) - stoi.keys())
        if missing:
            raise ValueError(f"characters {missing!r} are not in the vocabulary")
        return [stoi[c] for c in text]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return "".join(self.chars[i] for i in self._valid(ids))

    def to_meta(self) -> dict[str, Any]:
        return {"kind": "chars", "chars": self.chars}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.chars == self.chars

    __hash__ = None


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, and 256 for end-of-text: 257 ids."""

    vocab_size = 257
    eot_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        out, run = [], bytearray()
        for i in self._valid(ids):
            if i == self.eot_id:
                out += [run.decode("utf-8", errors="replace"), EOT_TEXT]
                run = bytearray()
            else:
                run.append(i)
        return "".join([*out, run.decode("utf-8", errors="replace")])

    def to_meta(self) -> dict[str, Any]:
        return {"kind": "bytes"}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteTokenizer)

    __hash__ = None


class TiktokenTokenizer(Tokenizer):
    """A `tiktoken.Encoding`; `encode` is `encode_ordinary` (special tokens in the text are
    plain text), and the end-of-text id is the encoding's `eot_token`."""

    def __init__(self, encoding: Any, name: str | None = None):
        self.encoding = encoding
        self.name = name or encoding.name
        self.vocab_size = int(encoding.n_vocab)
        self.eot_id = int(encoding.eot_token)

    @classmethod
    def gpt2(cls) -> TiktokenTokenizer:
        """GPT-2's encoding (tiktoken downloads its 1.6 MB of ranks once and caches them).

        Raises:
          OSError: tiktoken is missing, or the ranks are neither cached nor downloadable;
            the message says how to get them.
        """
        try:
            import tiktoken
        except ImportError:
            raise OSError("--tokenizer=gpt2 needs tiktoken: pip install -e '.[data]' (or "
                          "pip install tiktoken)") from None
        try:
            return cls(tiktoken.get_encoding("gpt2"), "gpt2")
        except Exception as err:  # requests' and urllib's errors alike: offline
            cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get(
                "DATA_GYM_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "data-gym-cache")
            raise OSError(
                f"tiktoken could not load GPT-2's encoding ({type(err).__name__}): it downloads "
                "it once on first use; run `python -c \"import tiktoken; tiktoken.get_encoding"
                "('gpt2')\"` on a machine with a network and copy its cache folder "
                f"({cache}) here, with TIKTOKEN_CACHE_DIR set to it"
            ) from None

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self.encoding.decode(self._valid(ids))

    def to_meta(self) -> dict[str, Any]:
        return {"kind": "tiktoken", "name": self.name}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TiktokenTokenizer) and other.name == self.name and (
            other.vocab_size == self.vocab_size)

    __hash__ = None


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers.Tokenizer` read from a `tokenizer.json`.

    The end-of-text id is `eot` if given, else the first of `<|endoftext|>`, `</s>`,
    `<eos>`, `[SEP]` the vocabulary holds; a vocabulary with none of them has no
    end-of-text id (`python -m train.prepare` then refuses it and asks for `--eot`).
    `encode` reads special tokens in the text as plain text, as `TiktokenTokenizer` does
    (a document quoting `<|endoftext|>` gets no end-of-text id from it).
    """

    _EOT_CANDIDATES = (EOT_TEXT, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")

    def __init__(self, path: str | os.PathLike, eot: str | None = None):
        try:
            import tokenizers
        except ImportError:
            raise OSError(f"--tokenizer={str(path)!r} needs the tokenizers package: pip "
                          "install -e '.[data]' (or pip install tokenizers)") from None
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer {str(path)!r}: no such file (expected a "
                                    "Hugging Face tokenizer.json)")
        try:
            self.tokenizer = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as err:
            raise ValueError(f"tokenizer {str(path)!r} is not a Hugging Face tokenizer.json "
                             f"({err})") from None
        self.tokenizer.encode_special_tokens = True
        self.vocab_size = int(self.tokenizer.get_vocab_size(with_added_tokens=True))
        names = (eot,) if eot is not None else self._EOT_CANDIDATES
        ids = [self.tokenizer.token_to_id(n) for n in names]
        self.eot_name = next((n for n, i in zip(names, ids, strict=True) if i is not None), None)
        self.eot_id = next((i for i in ids if i is not None), None)
        if eot is not None and self.eot_id is None:
            raise ValueError(f"--eot={eot!r}: no such token in {str(path)!r}")

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)  # the flag is not part of a pickled tokenizers.Tokenizer
        self.tokenizer.encode_special_tokens = True

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self.tokenizer.decode(self._valid(ids), skip_special_tokens=False)

    def to_meta(self) -> dict[str, Any]:
        return {"kind": "huggingface", "file": str(self.path), "eot": self.eot_name}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HFTokenizer) and (
            other.tokenizer.to_str() == self.tokenizer.to_str())

    __hash__ = None


def get_tokenizer(name: str, *, eot: str | None = None) -> Tokenizer:
    """`"gpt2"`, `"bytes"`, or the path of a `tokenizer.json` (with `eot`, its end-of-text
    token's name)."""
    if name == "gpt2":
        return TiktokenTokenizer.gpt2()
    if name == "bytes":
        return ByteTokenizer()
    return HFTokenizer(name, eot=eot)


def from_meta(meta: Mapping[str, Any], root: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer `meta` (a `to_meta()` dict) describes; a relative `tokenizer.json` path
    is taken from `root`.

    Raises:
      ValueError: for an unknown kind.
    """
    kind = meta.get("kind")
    if kind == "chars":
        return CharTokenizer(meta["chars"])
    if kind == "bytes":
        return ByteTokenizer()
    if kind == "tiktoken":
        if meta.get("name") != "gpt2":
            raise ValueError(f"tokenizer {dict(meta)}: only tiktoken's gpt2 is known")
        return TiktokenTokenizer.gpt2()
    if kind == "huggingface":
        path = Path(meta["file"])
        if not path.is_absolute() and root is not None:
            path = Path(root) / path
        return HFTokenizer(path, eot=meta.get("eot"))
    raise ValueError(f"tokenizer {dict(meta)}: unknown kind {kind!r}; expected chars, bytes, "
                     "tiktoken or huggingface")


def describe_meta(meta: Mapping[str, Any]) -> str:
    """A tokenizer description (`to_meta()`) in words, for error messages."""
    if meta.get("kind") == "chars":
        return f"a vocabulary of {len(meta['chars'])} characters"
    return ", ".join(f"{k}={v}" for k, v in meta.items() if k != "sha256")


#: A prompt that starts with this names a UTF-8 file holding the prompt.
PROMPT_FILE = "FILE:"


def read_prompt(start: str, *, flag: str = "--start") -> str:
    """The prompt `start` names: its text, or with `FILE:path` that file's (UTF-8) text.

    Raises:
      OSError, ValueError: the file cannot be read or is not UTF-8, in one line naming
        `flag` and the file.
    """
    if not start.startswith(PROMPT_FILE):
        return start
    path = Path(start[len(PROMPT_FILE):]).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{flag}={start!r}: {str(path)!r} is not UTF-8 text (byte "
                         f"{err.start}: {err.reason}); expected a UTF-8 prompt file") from None
    except OSError as err:
        raise type(err)(f"{flag}={start!r}: cannot read the prompt file {str(path)!r} "
                        f"({err.strerror or err})") from None


def prompt_ids(tokenizer: Tokenizer, prompt: str, *, flag: str = "--start") -> list[int]:
    """`prompt`'s ids, or, for an empty prompt, the end-of-text id (a document's start; id
    0 for a character vocabulary).

    Raises:
      ValueError: a character the vocabulary lacks, in one line naming `flag`.
    """
    if not prompt:
        return [tokenizer.eot_id or 0]
    try:
        return list(tokenizer.encode(prompt))
    except ValueError as err:
        raise ValueError(f"{flag}={prompt!r}: {err}") from None
