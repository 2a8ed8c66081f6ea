"""Distributed input (being split into one job a file: see `datasets.py` for now)."""

from jstrategy._src.input.datasets import DistributedDataset
from jstrategy._src.input.datasets import DistributedIterator
from jstrategy._src.input.datasets import InputContext
from jstrategy._src.input.datasets import InputOptions
from jstrategy._src.input.datasets import InputReplicationMode
from jstrategy._src.input.datasets import distribute_batch
from jstrategy._src.input.datasets import distribute_dataset
from jstrategy._src.input.datasets import distribute_datasets_from_function
from jstrategy._src.input.datasets import full_mask
from jstrategy._src.input.datasets import pad_rows
from jstrategy._src.input.datasets import process_local_batch
from jstrategy._src.input.datasets import process_row_slices
from jstrategy._src.input.datasets import put_rows
from jstrategy._src.input.datasets import replica_row_slices

__all__ = [
    "DistributedDataset",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "distribute_batch",
    "distribute_dataset",
    "distribute_datasets_from_function",
    "full_mask",
    "pad_rows",
    "process_local_batch",
    "process_row_slices",
    "put_rows",
    "replica_row_slices",
]
