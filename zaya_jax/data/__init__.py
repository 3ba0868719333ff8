"""Training data: document sources, tokenizers, packing into rows, and the Grain pipeline."""

from zaya_jax.data.mixture import SourceSpec, parse_mixture
from zaya_jax.data.packing import PackedRows, pack_documents
from zaya_jax.data.pipeline import DataPipeline, DataSettings, split_documents
from zaya_jax.data.sources import open_source
from zaya_jax.data.stream_packing import PackedRowsIterDataset
from zaya_jax.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataPipeline",
    "DataSettings",
    "HFTokenizer",
    "PackedRows",
    "PackedRowsIterDataset",
    "SourceSpec",
    "load_tokenizer",
    "open_source",
    "pack_documents",
    "parse_mixture",
    "split_documents",
]
