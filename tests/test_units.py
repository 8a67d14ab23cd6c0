"""The one size rule and the one page size (kvswap.common.units), and that the daemon's size
flags and the remote URL read sizes the same way."""

from __future__ import annotations

import click
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvswap.backends.remote_url import RemoteConfigError, parse_remote_url
from kvswap.common.units import PAGE_BYTES, SIZE_UNITS, parse_size, round_up_to_page
from kvswap.daemon.cli import BYTES
from kvswap.daemon.staging import StagingPool


@pytest.mark.parametrize("text, expected", [
    ("0", 0), ("4096", 4096), (" 4096 ", 4096), ("256M", 256 << 20), ("256 MiB", 256 << 20), ("256mb", 256 << 20),
    ("1.5GiB", 3 << 29), ("1.5g", 3 << 29), (".5k", 512), ("2T", 2 << 40), ("1b", 1), ("0.3k", 307), (17, 17),
])
def test_sizes_parse_by_one_rule(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1", "+1", "1e9", "nan", "inf", "1.5.2G", "12 parsecs", "GiB", "1 G B", -5,
                                  True])
def test_not_sizes_are_refused(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("text", ["1.5GiB", "256M", "64 mib", "16777216", "0.25T"])
def test_flag_and_remote_url_agree(text):
    """The bug this prevents: --host-tier-bytes refused ``1.5GiB`` while the remote URL's
    ``segment=1.5GiB`` was accepted. Both now call parse_size."""
    flag = BYTES.convert(text, None, None)
    segment = parse_remote_url(f"mooncake://m:1?segment={text.replace(' ', '')}").segment
    assert flag == segment == parse_size(text)


def test_flag_and_remote_url_refuse_alike():
    with pytest.raises(click.BadParameter, match="not a size"):
        BYTES.convert("1e9", None, None)
    with pytest.raises(RemoteConfigError, match="size such as"):
        parse_remote_url("mooncake://m:1?segment=1e9")


@given(st.integers(0, 2**50), st.sampled_from(sorted(SIZE_UNITS)))
def test_integer_sizes_scale_exactly(number, unit):
    assert parse_size(f"{number}{unit}") == number * SIZE_UNITS[unit]
    assert parse_size(f"{number} {unit.upper()}") == number * SIZE_UNITS[unit]


@given(st.integers(1, 2**40))
def test_slots_round_to_whole_pages(nbytes):
    rounded = round_up_to_page(nbytes)
    assert rounded % PAGE_BYTES == 0 and nbytes <= rounded < nbytes + PAGE_BYTES
    assert round_up_to_page(nbytes) == rounded


def test_staging_pool_uses_the_slot_rule():
    pool = StagingPool(PAGE_BYTES + 1, budget_bytes=4 * PAGE_BYTES)
    assert pool.slot_bytes == round_up_to_page(PAGE_BYTES + 1) == 2 * PAGE_BYTES and pool.capacity == 2
