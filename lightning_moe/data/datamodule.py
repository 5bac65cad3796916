"""`LMDataModule`: fixed-length language-model windows, sharded over data-parallel ranks only.

Data comes from the embedded corpus (`lightning_moe.data.corpus`), from a Megatron
indexed dataset (``data_path`` prefix of ``.bin``/``.idx``), or from local text / JSONL files
tokenized with a local Hugging Face tokenizer (``text_files`` + ``tokenizer``, see
`lightning_moe.data.text`: documents packed with EOS between them, the last window padded
with labels -100).

Sampling. Window ``i`` is ``tokens[i*S : i*S + S + 1]`` of the flat token stream (documents
back to back, each followed by its separator where the data has one), split into
``input_ids`` and ``labels`` shifted by one. Training windows are shuffled by a
``DistributedSampler(shuffle=True, seed=seed, drop_last=True)`` whose ``num_replicas`` and
``rank`` come from ``trainer.strategy.distributed_sampler_kwargs``: `MegatronMoEStrategy`
reports the data-parallel size and rank there, so tensor-, context- and expert-parallel
peers read the same batch. Its permutation of all windows depends only on ``seed`` and the
epoch, and rank ``r`` takes every ``num_replicas``-th entry, so one optimizer step consumes
the same windows for every layout with the same global batch
(``dp * micro_batch_size * accumulate_grad_batches``).

Lightning. Lightning 2.6 replaces a DataLoader's sampler only when it is not already a
``DistributedSampler`` (``_DataConnector._requires_distributed_sampler``), so the sampler
built here is kept whatever ``use_distributed_sampler`` says, and the fit loop calls its
``set_epoch`` at each epoch start. In a plain loop, call ``loader.sampler.set_epoch(epoch)``.
One exception: ``Trainer(overfit_batches=...)`` swaps in a ``SequentialSampler`` on every
rank (Lightning's ``_resolve_overfit_batches``), so all data-parallel ranks then read the
same windows.

Packing. With ``pack_sequences=True`` the windows are the same, and each sample also carries
``position_ids`` and ``document_ids`` ``[S]`` (positions restart at 0 at each document, attention
stays inside it) and no label crosses a document boundary (`lightning_moe.data.packing`).
Document boundaries come from the corpus's document offsets, the indexed dataset's document
index, or the text files' documents.

Resuming. The training loader is a :class:`ResumableDataLoader`, stateful in Lightning's
sense: a checkpoint holds its position (epoch, windows trained), and a fit resumed from it,
mid-epoch included, reads exactly the batches an uninterrupted run would have read.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, DistributedSampler

from lightning_moe.data.corpus import VOCAB_SIZE, load_corpus
from lightning_moe.data.indexed_dataset import IndexedDataset, IndexedDatasetNotFoundError, MappedTokens
from lightning_moe.data.packing import PackedDocumentDataset
from lightning_moe.data.text import PackedTokenDataset, build_text_datasets, load_tokenizer
from lightning_moe.data.text import text_files as list_text_files
from lightning_moe.data.windows import LazyTokenWindows


class TokenWindowDataset(LazyTokenWindows):
    """Non-overlapping windows of ``seq_length`` tokens (+1 for the shifted labels).

    Item ``i`` is ``{"input_ids": tokens[i*S : i*S+S], "labels": tokens[i*S+1 : i*S+S+1]}``,
    both ``int64 [S]``. The last token of the stream is only ever a label.

    Args:
        tokens: a 1-D array, or a ``MappedTokens`` file range that is mapped lazily (and
            re-mapped in each DataLoader worker instead of being copied into it).
        seq_length: ``S``.
    """

    def __init__(self, tokens: Union[np.ndarray, MappedTokens], seq_length: int) -> None:
        super().__init__(tokens, seq_length)
        self._num_windows = max(0, (len(tokens) - 1) // seq_length)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens, start = self._stream(i), i * self.seq_length
        window = torch.from_numpy(tokens[start : start + self.seq_length + 1].astype(np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}


def _file_range(tokens: np.ndarray) -> Union[np.ndarray, MappedTokens]:
    """A cached corpus stream (``np.load(mmap_mode="r")``) as a file range, so DataLoader
    workers map the cache file instead of receiving a pickled copy; in-memory arrays as is."""
    if isinstance(tokens, np.memmap) and tokens.filename is not None:
        return MappedTokens(tokens.filename, tokens.dtype.str, int(tokens.offset), int(tokens.size))
    return tokens


class _ResumableSampler(DistributedSampler):
    """A DistributedSampler whose pass over epoch ``e`` can start after its first ``n`` indices (resume)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._skip = 0
        self._skip_epoch: Optional[int] = None

    def skip_once(self, num_indices: int, epoch: Optional[int] = None) -> None:
        """Start the next pass after ``num_indices`` indices, if it is over ``epoch`` (None: any)."""
        self._skip, self._skip_epoch = num_indices, epoch

    def __iter__(self):
        indices = list(super().__iter__())
        skip, self._skip = self._skip, 0
        if self._skip_epoch is not None and self._skip_epoch != self.epoch:
            skip = 0  # the loop went on to another epoch than the one the position was saved in
        return iter(indices[skip:])


class ResumableDataLoader(DataLoader):
    """The training DataLoader, stateful in Lightning's sense (``state_dict`` / ``load_state_dict``).

    ``state_dict()`` is where the next batch comes from: ``{"epoch": e, "samples": n}``, ``n``
    the windows of epoch ``e`` already trained over all data-parallel ranks (so a resume may
    change the data-parallel size while keeping the global batch), ``{"epoch": e + 1,
    "samples": 0}`` once epoch ``e``'s data ran out. Lightning's fit loop saves it in a
    checkpoint (``loops.fit_loop.state_dict.combined_loader``) and, when a fit resumes, hands it
    to ``load_state_dict`` before it iterates: the sampler takes the epoch and skips those
    windows, so the resumed run reads the batches an uninterrupted one would have read.

    Args (besides DataLoader's):
        position: ``() -> (batches of the current epoch trained, whether its data ran out)``;
            :class:`LMDataModule` passes the fit loop's count. Lightning fetches a batch ahead
            of the one it trains, so the batches this loader handed out overcount by one; they
            are the position only without ``position`` (a plain loop that saves after
            training each batch it drew).
    """

    def __init__(
        self, *args: Any, position: Optional[Callable[[], tuple[int, bool]]] = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._position = position
        self._handed_out = 0

    def __iter__(self) -> Iterator[Any]:
        self._handed_out = 0
        for batch in super().__iter__():
            self._handed_out += 1
            yield batch

    def _replicas(self) -> int:
        return int(getattr(self.sampler, "num_replicas", 1))

    def state_dict(self) -> dict[str, int]:
        epoch = int(getattr(self.sampler, "epoch", 0))
        done, ran_out = self._position() if self._position is not None else (self._handed_out, False)
        if ran_out or done >= len(self):
            return {"epoch": epoch + 1, "samples": 0}
        return {"epoch": epoch, "samples": done * int(self.batch_size or 1) * self._replicas()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, samples = int(state["epoch"]), int(state["samples"])
        if hasattr(self.sampler, "set_epoch"):
            # Before Lightning's own set_epoch: a loader with workers draws its first indices
            # when the iterator is created, which Lightning does before it sets the epoch.
            self.sampler.set_epoch(epoch)
        per_rank, rest = divmod(samples, self._replicas())
        if rest:
            warnings.warn(
                f"the checkpoint's data position ({samples} windows of epoch {epoch}) does not split evenly "
                f"over {self._replicas()} data-parallel ranks: resuming after {per_rank} windows per rank.",
                stacklevel=2,
            )
        if isinstance(self.sampler, _ResumableSampler):  # replaces a position guessed at creation
            self.sampler.skip_once(per_rank if per_rank < len(self.sampler) else 0, epoch)


class LMDataModule(LightningDataModule):
    """Language-model batches ``{"input_ids": [B, S], "labels": [B, S]}`` (int64), with
    ``position_ids`` and ``document_ids`` ``[B, S]`` too when ``pack_sequences``.

    Args:
        seq_length: tokens per sample ``S``.
        micro_batch_size: samples per rank per step ``B``.
        num_workers: DataLoader worker processes.
        data_path: Megatron ``.bin``/``.idx`` path prefix; None uses the embedded corpus.
        max_corpus_bytes: cap on the embedded corpus size (None: all of it).
        seed: seed of the training shuffle (the epoch is added by ``set_epoch``).
        val_fraction: share of documents held out for validation. Corpus: documents chosen by
            path hash (see `corpus`). ``data_path``: the last documents, Megatron-style
            contiguous split; 0 disables validation there.
        vocab_size: vocabulary size for ``data_path`` (default: largest token id + 1, one pass
            over the data) or for ``text_files`` (default: the tokenizer's ``len``; a larger value
            is allowed, e.g. a model's padded vocabulary). The corpus always has 256.
        text_files: local text files (one document each), JSONL files (one document per line)
            or directories of them; needs ``tokenizer``. Validation: the last ``val_fraction``
            of the documents.
        tokenizer: local directory of a Hugging Face tokenizer (``save_pretrained``), loaded
            without network access; its EOS token separates the packed documents.
        text_field: the JSONL field that holds a document's text.
        pack_sequences: keep the documents of a window apart: per-document ``position_ids``,
            ``document_ids`` for attention masking, and label -100 on each document's last token
            (Megatron's ``reset_position_ids``, ``reset_attention_mask`` and ``eod_mask_loss``).
    """

    def __init__(
        self,
        seq_length: int,
        micro_batch_size: int,
        num_workers: int = 0,
        data_path: Optional[str] = None,
        max_corpus_bytes: Optional[int] = None,
        seed: int = 1234,
        val_fraction: float = 0.02,
        vocab_size: Optional[int] = None,
        text_files: Optional[Union[str, list[str]]] = None,
        tokenizer: Optional[str] = None,
        text_field: str = "text",
        pack_sequences: bool = False,
    ) -> None:
        super().__init__()
        if seq_length < 1 or micro_batch_size < 1:
            raise ValueError(
                f"seq_length and micro_batch_size must be >= 1, got {seq_length} and {micro_batch_size}"
            )
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if (text_files is None) != (tokenizer is None):
            raise ValueError("text_files and tokenizer go together: give both (local files and the local tokenizer "
                             "directory) or neither")
        if text_files is not None and (data_path is not None or max_corpus_bytes is not None):
            raise ValueError("text_files replaces the corpus and data_path: drop data_path / max_corpus_bytes")
        if data_path is None and text_files is None and vocab_size not in (None, VOCAB_SIZE):
            raise ValueError(
                f"the embedded corpus is byte-level (vocab_size {VOCAB_SIZE}); drop vocab_size={vocab_size} "
                "or pass data_path"
            )
        if data_path is not None and max_corpus_bytes is not None:
            raise ValueError("max_corpus_bytes applies to the embedded corpus only; drop it or data_path")
        self.save_hyperparameters()
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.num_workers = num_workers
        self.data_path = data_path
        self.max_corpus_bytes = max_corpus_bytes
        self.seed = seed
        self.val_fraction = val_fraction
        self._vocab_size = vocab_size
        self._indexed: Optional[IndexedDataset] = None
        self.text_files = text_files
        self.text_field = text_field
        self.pack_sequences = pack_sequences
        self.tokenizer_path = tokenizer
        self._tokenizer: Any = None
        if text_files is not None:
            list_text_files(text_files)  # a missing file fails at construction, not once the fit starts
        self.train_dataset: Optional[Union[TokenWindowDataset, PackedTokenDataset, PackedDocumentDataset]] = None
        self.val_dataset: Optional[Union[TokenWindowDataset, PackedTokenDataset, PackedDocumentDataset]] = None

    @property
    def tokenizer(self) -> Any:
        """The ``text_files`` tokenizer (loaded from its local directory on first use), else None."""
        if self._tokenizer is None and self.tokenizer_path is not None:
            self._tokenizer = load_tokenizer(self.tokenizer_path)
            if self._vocab_size is not None and self._vocab_size < len(self._tokenizer):
                raise ValueError(f"vocab_size={self._vocab_size} is smaller than the tokenizer's "
                                 f"{len(self._tokenizer)} tokens: raise it or drop it")
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Vocabulary size: 256 for the corpus; explicit or largest token id + 1 for ``data_path``;
        explicit or the tokenizer's size for ``text_files``."""
        if self.tokenizer_path is not None:
            tokens = len(self.tokenizer)  # loading it checks an explicit vocab_size against it
            return self._vocab_size if self._vocab_size is not None else tokens
        if self.data_path is None:
            return VOCAB_SIZE
        if self._vocab_size is None:
            self._vocab_size = self._indexed_dataset().max_token() + 1
        return self._vocab_size

    def _indexed_dataset(self) -> IndexedDataset:
        if self._indexed is None:
            try:
                self._indexed = IndexedDataset(self.data_path)
            except IndexedDatasetNotFoundError as err:
                raise IndexedDatasetNotFoundError(
                    f"data_path: {err} Or leave data_path unset to train on the embedded corpus."
                ) from None
        return self._indexed

    def prepare_data(self) -> None:
        """Build the corpus cache once per node (Lightning calls this on local rank 0)."""
        if self.data_path is None:
            load_corpus(max_bytes=self.max_corpus_bytes, val_fraction=self.val_fraction)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_dataset is not None:
            return
        if self.text_files is not None:
            self.train_dataset, self.val_dataset = build_text_datasets(
                self.text_files, self.tokenizer, self.seq_length, self.val_fraction, self.text_field,
                self.pack_sequences,
            )
            self._check_enough_windows()
            return
        if self.data_path is None:
            corpus = load_corpus(max_bytes=self.max_corpus_bytes, val_fraction=self.val_fraction)
            train, val = _file_range(corpus.train_tokens), _file_range(corpus.val_tokens)
            train_ends, val_ends = corpus.train_offsets[1:], corpus.val_offsets[1:]
        else:
            data = self._indexed_dataset()
            num_val = int(round(data.num_documents * self.val_fraction))
            if self.val_fraction > 0 and data.num_documents > 1:
                num_val = max(1, num_val)
            first_val = data.num_documents - num_val
            train = data.mapped_tokens(0, first_val)
            val = data.mapped_tokens(first_val, data.num_documents)
            train_ends, val_ends = data.document_ends(0, first_val), data.document_ends(first_val, data.num_documents)
        if self.pack_sequences:
            self.train_dataset = PackedDocumentDataset(train, train_ends, self.seq_length)
            self.val_dataset = PackedDocumentDataset(val, val_ends, self.seq_length)
        else:
            self.train_dataset = TokenWindowDataset(train, self.seq_length)
            self.val_dataset = TokenWindowDataset(val, self.seq_length)
        self._check_enough_windows()

    def _check_enough_windows(self) -> None:
        if len(self.train_dataset) < self._data_parallel_kwargs()["num_replicas"] * self.micro_batch_size:
            raise ValueError(
                f"{len(self.train_dataset)} training windows of {self.seq_length} tokens cannot fill one "
                f"micro-batch of {self.micro_batch_size} on every data-parallel rank; use more data "
                "(max_corpus_bytes) or a shorter seq_length"
            )

    def _data_parallel_kwargs(self) -> dict[str, int]:
        """``num_replicas``/``rank`` of this process's data-parallel group (1/0 without a trainer)."""
        strategy = getattr(self.trainer, "strategy", None)
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
        if not kwargs:
            return {"num_replicas": 1, "rank": 0}
        num_replicas, rank = int(kwargs["num_replicas"]), int(kwargs["rank"])
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"{type(strategy).__name__}.distributed_sampler_kwargs gave rank {rank} of {num_replicas}; "
                "set up the strategy (its devices/process group) before requesting dataloaders"
            )
        return {"num_replicas": num_replicas, "rank": rank}

    def _fit_position(self) -> tuple[int, bool]:
        """(micro-batches of the current epoch trained, whether its data ran out), from the fit
        loop: the training loader's ``state_dict`` (see :class:`ResumableDataLoader`)."""
        progress = self.trainer.fit_loop.epoch_loop.batch_progress
        # "processed": a checkpoint written in on_train_batch_end already counts its batch here
        # ("completed" is incremented only after that hook).
        return int(progress.current.processed), bool(progress.is_last_batch)

    def _batches_done_this_epoch(self) -> int:
        """Micro-batches of the current epoch already trained when a fit resumes mid-epoch, for a
        checkpoint without the loader's state (written before the loader was stateful).

        Lightning restores its loop counters before it asks for the training loader; the
        sampler then starts after the windows those batches used. A checkpoint with the
        loader's state replaces this guess through ``ResumableDataLoader.load_state_dict``.
        """
        loop = getattr(getattr(self.trainer, "fit_loop", None), "epoch_loop", None)
        if loop is None or loop.batch_progress.is_last_batch:
            return 0  # fresh run, or a checkpoint from the end of an epoch: the next epoch starts anew
        # "processed": a checkpoint written in on_train_batch_end already counts its batch here
        # ("completed" is incremented only after that hook).
        return int(loop.batch_progress.current.processed)

    def _loader(
        self, dataset: Union[TokenWindowDataset, PackedTokenDataset, PackedDocumentDataset], train: bool
    ) -> DataLoader:
        # The sampler's drop_last gives every data-parallel rank the same number of windows
        # (no rank waits in a collective for a batch another rank lacks) and reads no window
        # twice. Training also drops the last partial batch: every micro-batch is [B, S].
        sampler = _ResumableSampler(
            dataset, shuffle=train, seed=self.seed, drop_last=True, **self._data_parallel_kwargs()
        )
        kwargs: dict[str, Any] = {}
        if train:
            done = self._batches_done_this_epoch()
            if 0 < done < len(sampler) // self.micro_batch_size:
                sampler.skip_once(done * self.micro_batch_size)
            if self.trainer is not None:
                kwargs["position"] = self._fit_position
        return (ResumableDataLoader if train else DataLoader)(
            dataset,
            batch_size=self.micro_batch_size,
            sampler=sampler,
            drop_last=train,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
            **kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled (``seed`` + epoch), data-parallel-sharded training windows."""
        if self.train_dataset is None:
            self.setup()
        return self._loader(self.train_dataset, train=True)

    def val_dataloader(self) -> Union[DataLoader, list]:
        """Validation windows in order, data-parallel-sharded ([] when there are none)."""
        if self.val_dataset is None:
            self.setup()
        if len(self.val_dataset) == 0:
            return []
        return self._loader(self.val_dataset, train=False)


    def test_dataloader(self) -> Union[DataLoader, list]:
        """The held-out split (the embedded corpus and .bin data have one held-out split: the
        validation windows), in order and data-parallel-sharded."""
        return self.val_dataloader()


__all__ = ["LMDataModule", "ResumableDataLoader", "TokenWindowDataset"]
