"""Training data: corpora, tokenizers, packing into rows, and batches."""

from zaya_jax.data.corpus import BUILTIN_CORPORA, load_documents
from zaya_jax.data.loader import TextBatches
from zaya_jax.data.packing import PackedRows, pack_documents
from zaya_jax.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "BUILTIN_CORPORA",
    "ByteTokenizer",
    "HFTokenizer",
    "PackedRows",
    "TextBatches",
    "load_documents",
    "load_tokenizer",
    "pack_documents",
]
