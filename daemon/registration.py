"""An engine's registered cache: its layout, its memory mapped into the daemon, and the
mover that copies blocks in and out of it.

Everything an engine sends here is checked before anything is mapped for use: the region
list must be exactly the layout's, every handle must be large enough for every block of every
region placed in it.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from kvswap.backends.disk import pid_alive
from kvswap.protocol.errors import InvalidLayout, OutOfRange
from kvswap.protocol.layout import CacheLayout, int_field
from kvswap.protocol.shm import SharedSegment

from .movers.copy_plan import Placement
from .movers.gpu_plan import check_fits
from .movers.host import HostMover

#: Memory handle kinds a registration may use: POSIX shared memory (CPU engines, tests, the
#: demo) and CUDA IPC (an engine's GPU cache; see docs/gpu.md).
HANDLE_KINDS = ("shm", "cuda_ipc")

log = logging.getLogger(__name__)


class Registration:
    def __init__(self, layout: CacheLayout, placements: list[Placement], segments: list[SharedSegment],
                 mover: Any, pid: int) -> None:
        self.layout = layout
        self.namespace = layout.fingerprint()
        self.placements = placements
        self.segments = segments
        #: A HostMover (shm handles) or a GPU DeviceMover (cuda_ipc handles): the same
        #: record-level interface either way.
        self.mover = mover
        self.pid = pid

    @property
    def record_bytes(self) -> int:
        return self.layout.record_bytes

    @classmethod
    def attach(cls, layout_wire: dict[str, Any], handles: Sequence[dict[str, Any]],
               regions: Sequence[dict[str, Any]], pid: int, gpu_backend: str | None = None,
               gpu_staging_bytes: int | None = None) -> "Registration":
        """Validate and map an engine's cache. ``gpu_backend`` (``auto``, ``paddle``, ``cupy``;
        default: ``KVSWAP_GPU_BACKEND``, else ``auto``) and ``gpu_staging_bytes`` (device staging
        per mover) apply to ``cuda_ipc`` handles only."""
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
        segments: list[SharedSegment] = []
        try:
            for i, handle in enumerate(handles):
                declared = int_field(handle, "size", f"handles[{i}]", 1)
                segment = SharedSegment.attach(handle.get("name"))  # type: ignore[arg-type]
                segments.append(segment)
                if segment.size < declared:
                    raise InvalidLayout(f"handles[{i}] is {segment.size} bytes, smaller than the declared {declared}",
                                        field=f"handles[{i}].size")
            check_fits(placements, [seg.size for seg in segments], layout.num_blocks)
            buffers = [np.frombuffer(s.buffer, dtype=np.uint8) for s in segments]
        except BaseException:
            for s in segments:
                s.close()
            raise
        return cls(layout, placements, segments, HostMover(buffers, placements, layout.record_bytes), pid)

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
        self.mover.close()
        for segment in self.segments:
            if not segment.close():
                log.warning("segment %s still has views; it is unmapped when they go", segment.name)
        self.segments = []

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
        describe = getattr(self.mover, "describe", None)
        if describe is None:  # the host mover over shared memory
            return {"handles": [{"kind": "shm", "name": s.name, "size": s.size} for s in self.segments],
                    "mover": {"mover": "host"}}
        mover = dict(describe())
        return {"handles": mover.pop("handles", []), "mover": mover}
