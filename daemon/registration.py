"""An engine's registered cache: its layout, its memory mapped into the daemon, the mover
that copies blocks in and out of it, and the leases requests hold on it.

Everything an engine sends here is checked before anything is mapped for use: the region
list must be exactly the layout's, every handle must be large enough for every block of every
region placed in it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import TYPE_CHECKING, Any, Sequence

from kvswap.common.processes import pid_alive
from kvswap.common.shm import SharedSegment
from kvswap.protocol.errors import InvalidLayout, NotRegistered, OutOfRange
from kvswap.protocol.layout import CacheLayout, int_field

from .movers.base import Mover
from .movers.copy_plan import Placement
from .movers.gpu_plan import check_fits
from .movers.segment import SegmentMover

#: Memory handle kinds a registration may use: POSIX shared memory (CPU engines, tests, the
#: demo) and CUDA IPC (an engine's GPU cache; see docs/gpu.md).
HANDLE_KINDS = ("shm", "cuda_ipc")

if TYPE_CHECKING:
    from .tiers import NamespaceTiers

log = logging.getLogger(__name__)


class Lease:
    """A request's hold on a registration: while any lease is held the registration's memory
    stays mapped. Taken and released on the event loop; release is idempotent."""

    __slots__ = ("registration", "_held")

    def __init__(self, registration: "Registration") -> None:
        self.registration = registration
        self._held = True

    @property
    def tiers(self) -> "NamespaceTiers":
        assert self.registration.tiers is not None
        return self.registration.tiers

    def release(self) -> None:
        if self._held:
            self._held = False
            self.registration._leave()

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Registration:
    def __init__(self, layout: CacheLayout, placements: list[Placement], segments: list[SharedSegment],
                 mover: Mover, pid: int) -> None:
        self.layout = layout
        self.namespace = layout.fingerprint()
        self.placements = placements
        self.segments = segments
        #: A SegmentMover (shm handles) or a GPU DeviceMover (cuda_ipc handles): the same
        #: record-level interface either way.
        self.mover = mover
        #: The engine this registration belongs to (0: an engine that did not say).
        self.pid = pid
        #: Names this registration (not the engine): requests made under it carry it, so a
        #: request is never applied to a later registration, even from the same pid.
        self.token = secrets.token_hex(16)
        #: The namespace's stores, set when the registration is installed.
        self.tiers: NamespaceTiers | None = None
        self._users = 0
        self._closing = False
        self._idle: asyncio.Event | None = None

    @property
    def record_bytes(self) -> int:
        return self.layout.record_bytes

    @classmethod
    def attach(cls, layout_wire: dict[str, Any], handles: Sequence[dict[str, Any]],
               regions: Sequence[dict[str, Any]], pid: int, gpu_backend: str | None = None,
               gpu_staging_bytes: int | None = None) -> "Registration":
        """Validate and open an engine's cache. ``gpu_backend`` (the GPU framework: ``auto``,
        ``paddle``, ``cupy``; default: ``KVSWAP_GPU_BACKEND``, else ``auto``; both names keep
        the old word for compatibility) and ``gpu_staging_bytes`` (device staging per mover)
        apply to ``cuda_ipc`` handles only."""
        layout = CacheLayout.from_wire(layout_wire)
        placements = cls._placements(layout, handles, regions)
        kinds = [h.get("kind") for h in handles]
        for i, kind in enumerate(kinds):
            if kind not in HANDLE_KINDS:
                raise InvalidLayout(f"handles[{i}].kind {str(kind)[:32]!r} is not supported by this daemon; use one of "
                                    f"{', '.join(HANDLE_KINDS)}", field=f"handles[{i}].kind")
        if len(set(kinds)) > 1:
            raise InvalidLayout("all handles of a registration must be of one kind", kinds=sorted(set(kinds)))
        if kinds[0] == "cuda_ipc":
            # Imported here: a daemon serving shared memory never loads the GPU modules.
            from .movers.cuda_attach import DEFAULT_DEVICE_STAGING_BYTES, attach_cuda_ipc

            mover = attach_cuda_ipc(layout, placements, handles, gpu_backend,
                                    gpu_staging_bytes or DEFAULT_DEVICE_STAGING_BYTES)
            return cls(layout, placements, [], mover, pid)
        return cls._attach_shm(layout, placements, handles, pid)

    @classmethod
    def _attach_shm(cls, layout: CacheLayout, placements: list[Placement], handles: Sequence[dict[str, Any]],
                    pid: int) -> "Registration":
        # Opened, never mapped: see movers/segment.py for why (a truncated segment).
        segments: list[SharedSegment] = []
        try:
            for i, handle in enumerate(handles):
                declared = int_field(handle, "size", f"handles[{i}]", 1)
                segment = SharedSegment.attach(handle.get("name"), mapped=False)  # type: ignore[arg-type]
                segments.append(segment)
                if segment.size < declared:
                    raise InvalidLayout(f"handles[{i}] is {segment.size} bytes, smaller than the declared {declared}",
                                        field=f"handles[{i}].size")
            check_fits(placements, [seg.size for seg in segments], layout.num_blocks)
            mover = SegmentMover(segments, placements, layout.record_bytes, layout.num_blocks)
        except BaseException:
            for s in segments:
                s.close()
            raise
        return cls(layout, placements, segments, mover, pid)

    @staticmethod
    def _placements(layout: CacheLayout, handles: Sequence[dict[str, Any]],
                    regions: Sequence[dict[str, Any]]) -> list[Placement]:
        if not handles:
            raise InvalidLayout("a registration needs at least one memory handle")
        expected = layout.regions
        if len(regions) != len(expected):
            raise InvalidLayout(f"the layout has {len(expected)} regions, the registration lists {len(regions)}",
                                expected=len(expected), got=len(regions))
        placements = []
        for i, (entry, region) in enumerate(zip(regions, expected)):
            where = f"regions[{i}]"
            if entry.get("name") != region.name:
                raise InvalidLayout(f"{where} must be {region.name!r}, got {str(entry.get('name'))[:32]!r}",
                                    field=f"{where}.name")
            handle = int_field(entry, "handle", where)
            if handle >= len(handles):
                raise InvalidLayout(f"{where}.handle {handle} does not exist", field=f"{where}.handle")
            stride = int_field(entry, "stride", where, region.block_bytes)
            offset = int_field(entry, "offset", where)
            placements.append(Placement(region.name, handle, offset, stride, region.block_bytes, region.record_offset))
        return placements

    # -- leases (event loop only) ---------------------------------------------------------------

    def lease(self) -> Lease:
        if self._closing:
            raise NotRegistered("the registration was released", namespace=self.namespace)
        self._users += 1
        return Lease(self)

    def _leave(self) -> None:
        self._users -= 1
        if self._users == 0 and self._idle is not None:
            self._idle.set()

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def users(self) -> int:
        return self._users

    def close_soon(self) -> None:
        """Refuse new leases from now on; copies in progress stop at their next block."""
        self._closing = True

    async def drain(self) -> None:
        """Refuse new leases and wait until every lease held is released."""
        self._closing = True
        if self._users:
            self._idle = asyncio.Event()
            await self._idle.wait()

    # -- use ----------------------------------------------------------------------------------

    def check_blocks(self, block_ids: Sequence[int]) -> None:
        limit = self.layout.num_blocks
        for i, block in enumerate(block_ids):
            if block >= limit:
                raise OutOfRange(f"block id {block} is outside the registered pool of {limit} blocks",
                                 index=i, block_id=block, num_blocks=limit)

    def engine_alive(self) -> bool:
        return self.pid <= 0 or pid_alive(self.pid)

    def close(self) -> None:
        """Let go of the engine's memory (blocking: the mover waits for copies in progress)."""
        self.mover.close()
        for segment in self.segments:
            segment.close()

    def describe(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "layout": self.layout.to_wire(),
            "record_bytes": self.record_bytes,
            "regions": len(self.placements),
            "pid": self.pid,
            **self._describe_memory(),
        }

    def _describe_memory(self) -> dict[str, Any]:
        mover = dict(self.mover.describe())
        handles = mover.pop("handles", None)
        if handles is None:  # a mover over shared memory: the segments say what is mapped
            handles = [{"kind": "shm", "name": s.name, "size": s.size} for s in self.segments]
        return {"handles": handles, "mover": mover}
