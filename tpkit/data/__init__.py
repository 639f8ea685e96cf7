"""tpkit.data: the datasets, packed rows, and the batches that feed a layout (docs/data.md,
docs/context-parallel.md).

- the CP layout's functions users call on their batches (``shard_sequence``,
  ``unshard_sequence``, ``shard_position_ids``, ``shard_packed``, ``unshard_packed``, the
  divisibility rule ``check_sequence_length`` / ``sequence_multiple``): tpkit.cp's, here too;
- ``packing``: packed rows (``pack_sequences``, ``PackedBatch``);
- ``indexed``: Megatron-Core's ``.bin``/``.idx`` (read, write) and flat token files;
- ``text``: local Hugging Face tokenizers, jsonl/parquet/text/``datasets`` records, SFT;
- ``samples``: windows, packed rows, blends, splits, and the batches made of them;
- ``order``: the layout-independent sample order and its resumable position;
- ``build``: ``build_data``, one call from a data section to this rank's loader;
- ``preprocess``: the ``tpkit-data`` command (``python -m tpkit.data``).
"""
from ..cp.sharding import (check_sequence_length, sequence_multiple, shard_packed,
                         shard_position_ids, shard_sequence, unshard_packed, unshard_sequence)
from .packing import PackedBatch, pack_sequences
from .indexed import IndexedDataset, IndexedDatasetWriter, TokenFile, index_paths
from .text import Tokenizer, TokenizedDocuments, check_vocabulary, read_records, \
    sft_documents, text_documents
from .samples import Blend, PackedSamples, Subset, WindowSamples, count_targets, \
    packed_batch, split_bounds, split_documents, token_batch
from .order import Loader, dp_rows, epoch_order
from .build import Data, build_data, check_data, open_documents, parse_data_path

__all__ = [
    "check_sequence_length", "sequence_multiple", "shard_packed", "shard_position_ids",
    "shard_sequence", "unshard_packed", "unshard_sequence",
    "PackedBatch", "pack_sequences",
    "IndexedDataset", "IndexedDatasetWriter", "TokenFile", "index_paths",
    "Tokenizer", "TokenizedDocuments", "check_vocabulary", "read_records", "sft_documents",
    "text_documents",
    "Blend", "PackedSamples", "Subset", "WindowSamples", "count_targets", "packed_batch",
    "split_bounds", "split_documents",
    "token_batch",
    "Loader", "dp_rows", "epoch_order",
    "Data", "build_data", "check_data", "open_documents", "parse_data_path",
]
