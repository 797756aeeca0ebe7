"""Small tokenizers built locally for the tests (nothing is downloaded).

- `gpt2_like_encoding`: a `tiktoken.Encoding` with GPT-2's pre-tokenizer regex (written
  here from the GPT-2 paper's code, independently of `train.prepare.GPT2_PATTERN`), the
  256 single bytes as ranks 0..255, merges learned from a text by plain byte-pair
  counting, and `<|endoftext|>` as its one special token;
- `hf_bpe_json`: a Hugging Face BPE with a ByteLevel pre-tokenizer, trained with
  `tokenizers` on a text and saved as `tokenizer.json`.

References:
  Radford et al., "Language Models are Unsupervised Multitask Learners", OpenAI, 2019.
  Sennrich et al., "Neural Machine Translation of Rare Words with Subword Units" (BPE),
  https://arxiv.org/abs/1508.07909, 2016.
"""

import collections
import itertools
import os
from pathlib import Path

EOT = "<|endoftext|>"
#: GPT-2's pre-tokenizer: contractions, letter runs, digit runs, other runs (each with an
#: optional leading space), whitespace not followed by a non-space, other whitespace.
GPT2_REGEX = (r"'s|'t|'re|'ve|'m|'ll|'d"
              r"| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"
              r"|\s+(?!\S)|\s+")


def learn_merges(text: str, pattern: str, n_merges: int) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then the most frequent adjacent pair inside a
    pre-token merged `n_merges` times (ties broken by the pair's bytes)."""
    import regex

    words = collections.Counter(tuple(bytes([b]) for b in w.encode("utf-8"))
                                for w in regex.findall(pattern, text))
    ranks = {bytes([i]): i for i in range(256)}
    for _ in range(n_merges):
        pairs = collections.Counter()
        for word, count in words.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += count
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks.setdefault(a + b, len(ranks))
        merged = collections.Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return ranks


def gpt2_like_encoding(text: str, *, n_merges: int = 80, pattern: str = GPT2_REGEX,
                       name: str = "tiny_gpt2"):
    """A `tiktoken.Encoding` with GPT-2's regex, BPE merges learned from `text`."""
    import tiktoken

    ranks = learn_merges(text, pattern, n_merges)
    return tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens={EOT: len(ranks)})


def hf_bpe_json(text: str, path: Path, *, vocab_size: int = 400,
                special: tuple[str, ...] = (EOT,)) -> Path:
    """A byte-level BPE trained on `text` by `tokenizers`, saved as `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # no Rust threads before a test forks
    try:
        tok.train_from_iterator([text], trainer)
    finally:
        if saved is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    tok.save(str(path))
    return path
