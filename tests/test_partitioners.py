"""Partitioners: TF's arithmetic, documented examples and the sharded layout."""

import numpy as np
import pytest

from jstrategy._src.parameter_server.partitioners import shard_offsets
from jstrategy.experimental.partitioners import FixedShardsPartitioner
from jstrategy.experimental.partitioners import MaxSizePartitioner
from jstrategy.experimental.partitioners import MinSizePartitioner
from jstrategy.experimental.partitioners import Partitioner


def test_fixed_shards_documented_example():
    assert FixedShardsPartitioner(num_shards=2)((10, 3), np.float32) == [2, 1]


def test_fixed_shards_never_exceeds_the_axis():
    assert FixedShardsPartitioner(num_shards=8)((3, 2), np.float32) == [3, 1]
    assert FixedShardsPartitioner(num_shards=3)((4, 6), np.float32, axis=1) == [1, 3]


@pytest.mark.parametrize(
    ("max_shards", "expected"),
    [(2, [2, 1]), (10, [6, 1])],
)
def test_min_size_documented_examples(max_shards, expected):
    partitioner = MinSizePartitioner(min_shard_bytes=4, max_shards=max_shards)
    assert partitioner((6, 1), np.float32) == expected


def test_min_size_rounds_the_shard_count_up_and_keeps_at_least_one():
    # 100 float32 rows of 10 = 4000 bytes; 1000-byte minimum -> ceil(4.0) = 4 shards.
    assert MinSizePartitioner(min_shard_bytes=1000, max_shards=8)((100, 10), "float32") == [4, 1]
    # 4001 bytes would need ceil(4.001) = 5: one more shard, as TF's ceil.
    assert MinSizePartitioner(min_shard_bytes=1000, max_shards=8)((4001,), "int8") == [5]
    # The default (256 KiB, one shard) never splits.
    assert MinSizePartitioner()((1 << 20, 4), "float32") == [1, 1]
    assert MinSizePartitioner(min_shard_bytes=1 << 30, max_shards=4)((8, 8), "float32") == [1, 1]


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"max_shard_bytes": 4}, [6, 1]),
        ({"max_shard_bytes": 4, "max_shards": 2}, [2, 1]),
        ({"max_shard_bytes": 1024}, [1, 1]),
    ],
)
def test_max_size_documented_examples(kwargs, expected):
    assert MaxSizePartitioner(**kwargs)((6, 1), np.float32) == expected


def test_max_size_fits_whole_slices_per_shard():
    # Slices of 10 float32 = 40 bytes; 100 bytes hold 2 slices -> ceil(13 / 2) = 7 shards.
    assert MaxSizePartitioner(max_shard_bytes=100)((13, 10), "float32") == [7, 1]
    # A slice larger than the limit still gets its own shard.
    assert MaxSizePartitioner(max_shard_bytes=8)((3, 10), "float32") == [3, 1]


def test_strings_count_bytes_per_string():
    # 6 strings x 16 bytes = 96 bytes; 32-byte minimum -> 3 shards.
    assert MinSizePartitioner(min_shard_bytes=32, max_shards=10)((6,), np.str_) == [3]
    assert MinSizePartitioner(32, 10, bytes_per_string=64)((6,), object) == [6]
    assert MaxSizePartitioner(max_shard_bytes=32)((6,), np.str_) == [3]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: FixedShardsPartitioner(0), "num_shards"),
        (lambda: MinSizePartitioner(min_shard_bytes=0), "min_shard_bytes"),
        (lambda: MinSizePartitioner(max_shards=0), "max_shards"),
        (lambda: MinSizePartitioner(bytes_per_string=0), "bytes_per_string"),
        (lambda: MaxSizePartitioner(max_shard_bytes=0), "max_shard_bytes"),
        (lambda: MaxSizePartitioner(4, max_shards=-1), "max_shards"),
        (lambda: MaxSizePartitioner(4, bytes_per_string=0), "bytes_per_string"),
    ],
)
def test_invalid_arguments_are_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_scalar_shapes_and_bad_axes_are_rejected():
    with pytest.raises(ValueError, match="scalar"):
        FixedShardsPartitioner(2)((), np.float32)
    with pytest.raises(ValueError, match="axis"):
        FixedShardsPartitioner(2)((4, 2), np.float32, axis=2)


def test_partitioners_share_the_base_class():
    for partitioner in (FixedShardsPartitioner(2), MinSizePartitioner(), MaxSizePartitioner(8)):
        assert isinstance(partitioner, Partitioner)
    with pytest.raises(NotImplementedError):
        Partitioner()((4,), np.float32)


def test_div_layout_matches_tf():
    assert np.diff(shard_offsets(13, 5)).tolist() == [3, 3, 3, 2, 2]
    assert shard_offsets(10, 4) == [0, 3, 6, 8, 10]
    assert np.diff(shard_offsets(12, 4)).tolist() == [3, 3, 3, 3]
    assert shard_offsets(7, 1) == [0, 7]
    with pytest.raises(ValueError, match="num_shards"):
        shard_offsets(3, 4)
