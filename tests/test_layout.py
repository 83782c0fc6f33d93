"""Bucket layout: aligned slots, equal shards, and the gaps between them."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfz.engine.layout import ALIGN_BYTES, plan_bucket, stage2_bucket_bytes

shapes = st.lists(st.lists(st.integers(0, 70), min_size=0, max_size=3).map(tuple),
                  min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(shapes=shapes, itemsize=st.sampled_from([2, 4]), world_size=st.integers(1, 5))
def test_slots_gaps_and_shards_partition_the_bucket(shapes, itemsize, world_size):
    layout = plan_bucket(shapes, itemsize, world_size)
    align = ALIGN_BYTES // itemsize
    assert layout.padded_numel % (align * world_size) == 0
    assert layout.shard_numel * world_size == layout.padded_numel
    assert layout.shard_numel % align == 0          # every shard starts aligned
    covered = [(s.offset, s.offset + s.numel) for s in layout.slots if s.numel]
    for slot in layout.slots:
        assert slot.offset % align == 0
    # slots (non-empty ones) and gaps tile [0, padded) exactly, without overlap
    pieces = sorted(covered + layout.gaps())
    position = 0
    for start, stop in pieces:
        assert start == position and stop > start
        position = stop
    assert position == layout.padded_numel
    for rank in range(world_size):
        assert layout.shard_range(rank) == (rank * layout.shard_numel,
                                            (rank + 1) * layout.shard_numel)


def test_bad_layout_arguments_raise():
    with pytest.raises(ValueError, match="itemsize"):
        plan_bucket([(3,)], 8)
    with pytest.raises(ValueError, match="world_size"):
        plan_bucket([(3,)], 4, 0)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        plan_bucket([(3,)], 4, 2).shard_range(2)


def test_stage2_bucket_bytes(monkeypatch):
    monkeypatch.delenv("RLHFZ_BUCKET_BYTES", raising=False)
    assert stage2_bucket_bytes(1 << 40) == 32 << 20
    assert stage2_bucket_bytes(80 << 20) == 10 << 20
    assert stage2_bucket_bytes(1000) == 64 << 10
    monkeypatch.setenv("RLHFZ_BUCKET_BYTES", "4096")
    assert stage2_bucket_bytes(1 << 40) == 4096


@pytest.mark.parametrize("value", ["-100000000", "0", "4095", "abc", "1e6"])
def test_a_bucket_size_from_the_environment_below_a_page_is_refused(monkeypatch, value):
    """RLHFZ_BUCKET_BYTES obeys bucket_bytes='s rule, with its name in the error."""
    from rlhfz.estimate import estimate_bytes
    monkeypatch.setenv("RLHFZ_BUCKET_BYTES", value)
    rule = "RLHFZ_BUCKET_BYTES must be a whole number of bytes >= 4096"
    with pytest.raises(ValueError, match=rule):
        stage2_bucket_bytes(1 << 20)
    with pytest.raises(ValueError, match="RLHFZ_BUCKET_BYTES"):
        estimate_bytes(1_000_000, world_size=2, stage=2)
    assert stage2_bucket_bytes(1 << 20, 8192) == 8192       # an explicit cap reads no variable
