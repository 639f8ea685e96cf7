"""tpkit.data: context-parallel sharding of sequences and packed rows, and the datasets that
feed them (docs/data.md, docs/context-parallel.md).

- ``sharding``: the CP load-balanced layout (``shard_sequence``, ``pack_sequences``, ...);
- ``indexed``: Megatron-Core's ``.bin``/``.idx`` (read, write) and flat token files;
- ``text``: local Hugging Face tokenizers, jsonl/parquet/text/``datasets`` records, SFT;
- ``samples``: windows, packed rows, blends, splits, and the batches made of them;
- ``order``: the layout-independent sample order and its resumable position;
- ``build``: ``build_data``, one call from a data section to this rank's loader;
- ``preprocess``: the ``tpkit-data`` command (``python -m tpkit.data``).
"""
from .sharding import (PackedBatch, check_sequence_length, cp_chunk_ids, cp_positions,
                       last_sharded_length, note_sharded_length, pack_sequences,
                       packed_cp_indices, sequence_multiple, shard_packed, shard_position_ids,
                       shard_sequence, unshard_packed, unshard_sequence)
from .indexed import IndexedDataset, IndexedDatasetWriter, TokenFile, index_paths
from .text import Tokenizer, TokenizedDocuments, check_vocabulary, read_records, \
    sft_documents, text_documents
from .samples import Blend, PackedSamples, Subset, WindowSamples, count_targets, \
    packed_batch, split_bounds, split_documents, token_batch
from .order import Loader, dp_rows, epoch_order
from .build import Data, build_data, check_data, open_documents, parse_data_path

__all__ = [
    "PackedBatch", "check_sequence_length", "cp_chunk_ids", "cp_positions",
    "last_sharded_length", "note_sharded_length", "pack_sequences", "packed_cp_indices",
    "sequence_multiple", "shard_packed", "shard_position_ids", "shard_sequence",
    "unshard_packed", "unshard_sequence",
    "IndexedDataset", "IndexedDatasetWriter", "TokenFile", "index_paths",
    "Tokenizer", "TokenizedDocuments", "check_vocabulary", "read_records", "sft_documents",
    "text_documents",
    "Blend", "PackedSamples", "Subset", "WindowSamples", "count_targets", "packed_batch",
    "split_bounds", "split_documents",
    "token_batch",
    "Loader", "dp_rows", "epoch_order",
    "Data", "build_data", "check_data", "open_documents", "parse_data_path",
]
