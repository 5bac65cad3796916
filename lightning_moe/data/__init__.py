"""Training data: the embedded byte-level corpus, Megatron indexed datasets, local text, the DataModule."""

from lightning_moe.data.corpus import (
    EOD_TOKEN,
    VOCAB_SIZE,
    Corpus,
    decode,
    encode,
    load_corpus,
    unigram_entropy_bits,
    unigram_entropy_nats,
)
from lightning_moe.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, MappedTokens


def __getattr__(name: str):
    # The DataModule imports Lightning (seconds); the corpus and the indexed-dataset reader
    # stay importable, e.g. in a bare torch loop, without paying for it.
    if name in ("LMDataModule", "TokenWindowDataset"):
        from lightning_moe.data import datamodule

        return getattr(datamodule, name)
    if name == "PackedDocumentDataset":
        from lightning_moe.data import packing  # imports torch

        return packing.PackedDocumentDataset
    if name in ("PackedTokenDataset", "build_text_datasets", "load_tokenizer"):
        from lightning_moe.data import text  # imports torch

        return getattr(text, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Corpus",
    "EOD_TOKEN",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "LMDataModule",
    "MappedTokens",
    "PackedDocumentDataset",
    "PackedTokenDataset",
    "TokenWindowDataset",
    "VOCAB_SIZE",
    "build_text_datasets",
    "decode",
    "encode",
    "load_corpus",
    "load_tokenizer",
    "unigram_entropy_bits",
    "unigram_entropy_nats",
]
