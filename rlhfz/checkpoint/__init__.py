"""Checkpoints: one tensor file per rank plus a small JSON index, written
atomically and loaded shard by shard into the optimizer's own memory.

A sharded checkpoint is a directory:

    index.json                              what the files hold, and which generation is current
    g-<token>/rank-00000-of-00002.safetensors   rank 0's shard of every bucket (+ the model's
    g-<token>/rank-00001-of-00002.safetensors   buffers and frozen params, in rank 0's file)

index.json carries a CRC-32 of itself; each tensor's bytes carry a CRC-32
per chunk. A consolidated checkpoint is a directory with model.pt and
optimizer.pt, torch.save files of whole state dicts in torch's formats.

Files hold tensors and JSON only: nothing from a checkpoint is ever
executed. The parts:
- format.py: the tensor files (the safetensors layout), written and read in
  pieces, and the private, durable file primitives;
- validation.py: reading the index and checking it, and the files, before
  any byte is loaded; CheckpointError;
- sharded.py: save_checkpoint and load_checkpoint, at any world size and
  stage;
- model_only.py: the same two with no optimizer: a model alone, saved, or
  loaded from a model-only or a full checkpoint;
- generations.py: a save's new generation, committed atomically;
- consolidated.py: save_consolidated, load_consolidated and
  full_model_state_dict, in torch's own formats.
"""
from .consolidated import (MODEL_FILE, OPTIMIZER_FILE, full_model_state_dict,
                           load_consolidated, save_consolidated)
from .format import CorruptFileError, TensorFile, TensorFileWriter
from .sharded import load_checkpoint, save_checkpoint
from .validation import CHECKSUM, FORMAT, INDEX, MAX_INDEX_BYTES, CheckpointError

__all__ = ["save_checkpoint", "load_checkpoint", "save_consolidated", "load_consolidated",
           "full_model_state_dict", "CheckpointError", "CorruptFileError", "TensorFile",
           "TensorFileWriter", "FORMAT", "INDEX", "CHECKSUM", "MODEL_FILE", "OPTIMIZER_FILE",
           "MAX_INDEX_BYTES"]
