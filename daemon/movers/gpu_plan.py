"""The GPU movers' decisions, as pure functions over integers and numpy arrays.

Everything a GPU mover decides before it touches a device lives here, so it runs (and is
tested byte for byte) on a CPU: which handle fields are valid, whether the regions fit the
mapped allocations, which bytes each kernel copies (:func:`chunk_table` for the CuPy kernel,
:class:`RowPlan` for paddle's gather/index_put), how host slots group into 2D copies, and how a
request splits into batches that fit the device staging. The numpy executors at the end run
the tables and plans exactly as the device does, on host memory: they are the CPU twins the
tests compare with the reference host mover (``HostMover`` in ``kvswap/testing/reference_mover.py``).

All of it derives from the one :func:`~kvswap.daemon.movers.copy_plan.copy_plan` model: a region
is ``block_bytes`` at ``offset + block * stride`` of a handle; a record is every region's
chunk in region order.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Final, Sequence, TypeVar

import numpy as np

from kvswap.protocol.cuda_export import HANDLE_KIND, IPC_HANDLE_BYTES
from kvswap.protocol.errors import InvalidLayout
from kvswap.protocol.layout import int_field

from .copy_plan import Placement, PlanArrays

T = TypeVar("T")

#: Largest piece one CUDA block of the chunk kernel copies; big chunks are split so every
#: multiprocessor gets work even when a request moves a single block. A multiple of 16, so
#: pieces keep their chunk's alignment.
MAX_PIECE: Final = 64 * 1024
#: Largest pitch a 2D copy is given (cuMemcpy2D's limit is at least this on every device).
MAX_PITCH: Final = 2**31 - 1
_UUID_RE: Final = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


# -- validating what the engine sent ----------------------------------------------------------


@dataclass(frozen=True)
class IpcHandleSpec:
    """One ``cuda_ipc`` handle entry, checked: a CUDA allocation of the engine's."""

    index: int
    ipc_handle: bytes
    size: int
    device: int
    device_uuid: str | None


def parse_cuda_handles(handles: Sequence[dict[str, Any]]) -> list[IpcHandleSpec]:
    """Check every field of every ``cuda_ipc`` handle before anything is opened."""
    specs = []
    for i, h in enumerate(handles):
        where = f"handles[{i}]"
        if h.get("kind") != HANDLE_KIND:
            raise InvalidLayout(f"{where}.kind must be {HANDLE_KIND!r}: one registration uses one kind of handle",
                                field=f"{where}.kind")
        raw = h.get("ipc_handle")
        if not isinstance(raw, (bytes, bytearray)) or len(raw) != IPC_HANDLE_BYTES:
            raise InvalidLayout(f"{where}.ipc_handle must be the {IPC_HANDLE_BYTES} bytes of a CUipcMemHandle",
                                field=f"{where}.ipc_handle")
        uuid = h.get("device_uuid")
        if uuid is not None and (not isinstance(uuid, str) or _UUID_RE.fullmatch(uuid) is None):
            raise InvalidLayout(f"{where}.device_uuid must look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx",
                                field=f"{where}.device_uuid")
        size, device = int_field(h, "size", where, 1), int_field(h, "device", where, 0)
        specs.append(IpcHandleSpec(i, bytes(raw), size, device, uuid))
    devices = {(s.device_uuid or s.device) for s in specs}
    if len(devices) > 1:
        raise InvalidLayout("the handles name more than one GPU; one daemon serves one GPU",
                            devices=sorted(map(str, devices)))
    return specs


def check_fits(placements: Sequence[Placement], sizes: Sequence[int], num_blocks: int) -> None:
    """Every block of every region must lie inside its handle."""
    for p in placements:
        need = p.end(num_blocks)
        have = sizes[p.handle]
        if need > have:
            raise InvalidLayout(f"region {p.name} needs {need} bytes of handle {p.handle}, which has {have}",
                                region=p.name, need=need, have=have)


# -- requests: batches, duplicates, host slots -----------------------------------------------


def records_per_batch(record_bytes: int, staging_bytes: int) -> int:
    """Records the device staging holds at once; always at least one."""
    return max(1, staging_bytes // max(1, record_bytes))


def batches(count: int, per_batch: int) -> list[range]:
    """``range(count)`` cut into consecutive pieces of at most ``per_batch``:
    ``batches(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]``."""
    return [range(i, min(i + per_batch, count)) for i in range(0, count, per_batch)]


def last_wins(block_ids: Sequence[int], items: Sequence[T]) -> tuple[list[int], list[T]]:
    """Keep only the last item for each block id, in order.

    A scatter writes its records one after another, so when a block id repeats the last
    record is what stays. Device kernels write in parallel, so the repeats are dropped before
    they run: ``last_wins([5, 3, 5], "abc") == ([3, 5], ["b", "c"])``.
    """
    last = {b: i for i, b in enumerate(block_ids)}
    keep = [i for i, b in enumerate(block_ids) if last[b] == i]
    return [block_ids[i] for i in keep], [items[i] for i in keep]


@dataclass(frozen=True)
class SlotRun:
    """Slots ``first .. first+count-1`` lie ``pitch`` bytes apart in host memory, so one 2D
    copy (``count`` rows of ``record_bytes``) serves them all."""

    first: int
    count: int
    pitch: int


def slot_runs(addresses: Sequence[int], record_bytes: int, max_pitch: int = MAX_PITCH) -> list[SlotRun]:
    """Group slots by equal spacing, in order.

    Staging slots come from one arena ``slot_bytes`` apart, so slots taken together are
    usually one run: with ``record_bytes = 100`` and addresses ``[4096, 8192, 12288, 40960,
    45056]`` the runs are ``SlotRun(0, 3, 4096)`` and ``SlotRun(3, 2, 4096)``. A spacing
    below ``record_bytes`` (overlap) or above ``max_pitch`` ends a run.
    """
    runs: list[SlotRun] = []
    i, n = 0, len(addresses)
    while i < n:
        j, pitch = i + 1, record_bytes
        if j < n and record_bytes <= addresses[j] - addresses[i] <= max_pitch:
            pitch = addresses[j] - addresses[i]
            while j < n and addresses[j] - addresses[j - 1] == pitch:
                j += 1
        runs.append(SlotRun(i, j - i, pitch))
        i = j
    return runs


# -- the chunk kernel's table (CuPy) -------------------------------------------------------------


def chunk_table(plan: PlanArrays, bases: Sequence[int], staging_base: int, gather: bool,
                max_piece: int = MAX_PIECE) -> np.ndarray:
    """The rows ``(source address, destination address, bytes)`` the chunk kernel copies,
    one CUDA block per row, as a ``[pieces, 3]`` uint64 array.

    ``bases[h]`` is where handle ``h`` is mapped; records go to (gather) or come from
    (scatter) ``staging_base + plan.staging_offset``. A chunk longer than ``max_piece`` becomes
    several pieces. Worked example: one chunk of 40 bytes from handle 0 mapped at 1000,
    engine offset 8, to staging at 5000, with ``max_piece=16``::

        [[1008, 5000, 16],
         [1024, 5016, 16],
         [1040, 5032,  8]]
    """
    if max_piece <= 0 or max_piece % 16:
        raise ValueError("max_piece must be a positive multiple of 16")
    if len(plan) == 0:
        return np.empty((0, 3), dtype=np.uint64)
    base = np.asarray(bases, dtype=np.uint64)
    engine = base[plan.handle] + plan.engine_offset.astype(np.uint64)
    staging = np.uint64(staging_base) + plan.staging_offset.astype(np.uint64)
    src, dst = (engine, staging) if gather else (staging, engine)
    nbytes = plan.nbytes.astype(np.int64)
    pieces = (nbytes + max_piece - 1) // max_piece
    owner = np.repeat(np.arange(len(nbytes)), pieces)
    within = np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    offset = within * max_piece
    table = np.empty((len(owner), 3), dtype=np.uint64)
    table[:, 0] = src[owner] + offset.astype(np.uint64)
    table[:, 1] = dst[owner] + offset.astype(np.uint64)
    table[:, 2] = np.minimum(nbytes[owner] - offset, max_piece).astype(np.uint64)
    return table


# -- row views (paddle) ---------------------------------------------------------------------------

#: Element type a row view is read as, by unit size: integer types every paddle build gathers
#: and index_puts on CPU and GPU (CPU paddle has no float16 gather; bits are bits anyway).
UNIT_DTYPES: Final = {8: "int64", 4: "int32", 2: "int16", 1: "uint8"}


@dataclass(frozen=True)
class RowView:
    """A 2D view ``[rows, row_bytes / unit]`` of handle ``handle`` starting ``start`` bytes in."""

    handle: int
    start: int
    row_bytes: int
    rows: int


@dataclass(frozen=True)
class RegionRows:
    """Where region ``name``'s blocks are in its view: block ``b`` is rows
    ``first + b * step .. + per_block - 1``; its chunk is record columns ``column .. column +
    width`` (in units)."""

    name: str
    view: int
    first: int
    step: int
    per_block: int
    column: int
    width: int


@dataclass(frozen=True)
class RowPlan:
    """How paddle moves blocks: every region as rows of a view of its handle, gathered by row
    index and concatenated along columns into records (or split and index_put back)."""

    unit: int
    views: tuple[RowView, ...]
    regions: tuple[RegionRows, ...]
    record_units: int

    @property
    def dtype(self) -> str:
        return UNIT_DTYPES[self.unit]

    def indices(self, block_ids: Sequence[int]) -> list[np.ndarray]:
        """Per region, the int64 row indices of ``block_ids``' chunks, block after block."""
        blocks = np.asarray(block_ids, dtype=np.int64).reshape(-1, 1)
        out = []
        for r in self.regions:
            rows = r.first + blocks * r.step + np.arange(r.per_block, dtype=np.int64)
            out.append(rows.reshape(-1))
        return out


def row_plan(placements: Sequence[Placement], sizes: Sequence[int], bases: Sequence[int],
             record_bytes: int) -> RowPlan:
    """The row views for ``placements`` in handles of ``sizes`` bytes mapped at ``bases``.

    A region's rows are ``g = gcd(block_bytes, stride)`` bytes, starting at ``offset mod g``,
    so a block is ``block_bytes / g`` whole rows and the next block ``stride / g`` rows on:
    an engine tensor ``[num_blocks, ...]`` (stride == block_bytes) is one row per block, and an
    interleaved layout (k and v of a block side by side, stride == 2 * block_bytes) is every
    other row. Rows are read as the widest integer unit that divides every row, start and
    mapping address. Worked example: k.0 at offset 0 and v.0 at offset 64 of one handle of 512
    bytes, 64 bytes per block, stride 128 (interleaved), mapped at 4096::

        unit 8 (int64); one view per region start:
          views   = [RowView(0, start=0, row_bytes=64, rows=8)]
          regions = [RegionRows("k.0", view=0, first=0, step=2, per_block=1, column=0, width=8),
                     RegionRows("v.0", view=0, first=1, step=2, per_block=1, column=8, width=8)]
        indices([3, 0]) == [[6, 0], [7, 1]]
    """
    geometry = []
    for p in placements:
        g = math.gcd(p.block_bytes, p.stride)
        geometry.append((p, g, p.offset % g))
    unit = next(u for u in (8, 4, 2, 1)
                if all(g % u == 0 and (bases[p.handle] + start) % u == 0 for p, g, start in geometry)
                and record_bytes % u == 0)
    views: dict[tuple[int, int, int], int] = {}
    view_list: list[RowView] = []
    regions = []
    for p, g, start in geometry:
        key = (p.handle, start, g)
        if key not in views:
            views[key] = len(view_list)
            view_list.append(RowView(p.handle, start, g, (sizes[p.handle] - start) // g))
        regions.append(RegionRows(p.name, views[key], (p.offset - start) // g, p.stride // g, p.block_bytes // g,
                                  p.record_offset // unit, p.block_bytes // unit))
    return RowPlan(unit, tuple(view_list), tuple(regions), record_bytes // unit)


# -- CPU twins: the device's work, executed with numpy on host memory -------------------------


class AddressSpace:
    """Host arrays addressed by their real addresses, so a chunk table built for them (with
    ``bases`` = their addresses) runs exactly as the kernel runs it, with every access bounds
    checked."""

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        self._ranges = sorted(((a.ctypes.data, a.reshape(-1).view(np.uint8)) for a in arrays),
                              key=lambda r: r[0])

    def view(self, address: int, nbytes: int) -> np.ndarray:
        for base, arr in self._ranges:
            if base <= address and address + nbytes <= base + arr.size:
                return arr[address - base: address - base + nbytes]
        raise IndexError(f"{nbytes} bytes at {address:#x} are outside every known buffer")


def run_chunk_table(table: np.ndarray, space: AddressSpace) -> None:
    """What the chunk kernel does: copy each row's bytes from source to destination."""
    for src, dst, n in table.tolist():
        space.view(dst, n)[:] = space.view(src, n)


def _row_views(plan: RowPlan, handles: Sequence[np.ndarray]) -> list[np.ndarray]:
    out = []
    for v in plan.views:
        flat = handles[v.handle].reshape(-1).view(np.uint8)
        out.append(flat[v.start: v.start + v.rows * v.row_bytes].reshape(v.rows, v.row_bytes))
    return out


def gather_rows(plan: RowPlan, handles: Sequence[np.ndarray], block_ids: Sequence[int]) -> np.ndarray:
    """What the paddle gather does: ``[len(block_ids), record_bytes]`` uint8 records."""
    views = _row_views(plan, handles)
    n = len(block_ids)
    parts = [views[r.view][idx].reshape(n, r.width * plan.unit)
             for r, idx in zip(plan.regions, plan.indices(block_ids))]
    return np.concatenate(parts, axis=1) if parts else np.empty((n, 0), np.uint8)


def scatter_rows(plan: RowPlan, handles: Sequence[np.ndarray], block_ids: Sequence[int],
                 records: np.ndarray) -> None:
    """What the paddle scatter does: records ``[n, record_bytes]`` back into their rows."""
    views = _row_views(plan, handles)
    records = records.reshape(len(block_ids), plan.record_units * plan.unit)
    for r, idx in zip(plan.regions, plan.indices(block_ids)):
        cols = records[:, r.column * plan.unit: (r.column + r.width) * plan.unit]
        views[r.view][idx] = cols.reshape(len(idx), views[r.view].shape[1])
