"""Tiny tokenizers built in-process (nothing is downloaded), shared by the tests."""

from __future__ import annotations

import json

from tokenizers import ByteLevelBPETokenizer
from transformers import BertTokenizer, RobertaTokenizerFast

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a long document needs a model that reads long documents",
    "hello world, this is a tiny corpus for a tiny tokenizer",
    "sliding windows and global tokens make attention cheaper",
]


def roberta_tokenizer() -> RobertaTokenizerFast:
    """A byte-level BPE tokenizer trained on :data:`SENTENCES` (specials <s>, <pad>, </s>, <unk>, <mask> = 0-4)."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        SENTENCES * 3, vocab_size=300, min_frequency=1, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    )
    merges = [
        tuple(m) if not isinstance(m, str) else tuple(m.split())
        for m in json.loads(bpe._tokenizer.to_str())["model"]["merges"]
    ]
    return RobertaTokenizerFast(vocab=bpe.get_vocab(), merges=merges)


def bert_tokenizer() -> BertTokenizer:
    """A WordPiece tokenizer over the words of :data:`SENTENCES` plus single letters."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = sorted({w.strip(",") for s in SENTENCES for w in s.split()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ","] + words + list(letters) + ["##" + c for c in letters]
    return BertTokenizer(vocab={token: i for i, token in enumerate(vocab)})
