"""Units every layer of kvswap shares: the page size, and how an operator writes a size.

This is the one owner of both rules. It lives in ``kvswap.common``, beneath everything that
uses it: the engine side (``kvswap.protocol.host_cache``) needs the page size as much as the
daemon and the backends do, and each of them imports from here.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Final

#: The page: staging slots, O_DIRECT buffers and offsets, the record header of large records
#: and the tensors of a host cache all align to it. 4 KiB is the page (and the logical block of
#: every storage device we meet; 512-byte devices accept 4 KiB alignment too).
PAGE_BYTES: Final = 4096


def round_up_to_page(nbytes: int) -> int:
    """The smallest multiple of :data:`PAGE_BYTES` that holds ``nbytes``.

    >>> round_up_to_page(1), round_up_to_page(4096), round_up_to_page(4097)
    (4096, 4096, 8192)
    """
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


#: Binary multiples whatever the spelling: ``k``, ``K``, ``KB``, ``KiB`` all mean 1024, as
#: operators of KV caches and Mooncake's own settings read them.
SIZE_UNITS: Final = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
                     "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
                     "tib": 1 << 40}
SIZE_EXAMPLES: Final = "4096, 256M, 512MiB or 1.5GiB"

_SIZE_RE: Final = re.compile(r"^(\d+(?:\.\d+)?|\.\d+)\s*([a-z]*)$")


def parse_size(text: str | int) -> int:
    """A byte count from ``4096``, ``256M``, ``256 MiB``, ``256mb`` or ``1.5GiB``.

    The rule: a non-negative decimal number (a fraction is allowed), optional spaces, then an
    optional unit from :data:`SIZE_UNITS` (case does not matter; every unit is binary). A
    fractional result is rounded down to a whole byte. Raises ``ValueError`` for anything
    else (signs, exponents, unknown units, ``nan``).

    >>> parse_size("1.5GiB"), parse_size("256 m"), parse_size(4096)
    (1610612736, 268435456, 4096)
    """
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a size such as {SIZE_EXAMPLES}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative, got {text}")
        return text
    match = _SIZE_RE.match(str(text).strip().lower())
    if not match or match.group(2) not in SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size such as {SIZE_EXAMPLES}")
    return int(Fraction(match.group(1)) * SIZE_UNITS[match.group(2)])
