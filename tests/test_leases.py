"""The lease rule, through the swapper itself: a registration's memory is let go only after
every request holding it has stopped copying. The mover is the seam: a real registration,
real stores and staging, and a mover whose copy waits on an event, so a release can be sent
while a copy is in progress."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from kvswap.daemon.config import Config
from kvswap.daemon.data_threads import run
from kvswap.daemon.metrics import Metrics
from kvswap.daemon.registrar import Caller
from kvswap.daemon.registration import Registration
from kvswap.daemon.swapper import Deadline, Swapper
from kvswap.daemon.tiers import open_backends
from kvswap.protocol import CacheLayout
from kvswap.protocol.errors import NotRegistered, Timeout


class GatedMover:
    """A Mover whose gather waits for ``go``; records whether it was closed mid-copy."""

    kind = "gated"
    batches_scatter = False

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.copying = 0
        self.closed = False
        self.closed_while_copying = False

    def gather_blocks(self, block_ids, slots, live) -> bool:
        self.copying += 1
        try:
            self.entered.set()
            assert self.go.wait(10)
            for slot in slots:
                if not live():
                    return False
                slot[:] = 7
            return True
        finally:
            self.copying -= 1

    def scatter_blocks(self, block_ids, slots, live) -> bool:
        return True

    def pin_host(self, array) -> bool:
        return False

    def describe(self) -> dict[str, Any]:
        return {"mover": self.kind}

    def close(self) -> None:
        self.closed_while_copying |= self.copying > 0
        self.closed = True


LAYOUT = CacheLayout("lease", num_layers=1, num_blocks=8, block_size=4, num_kv_heads=1, head_dim=8)


async def _install(swapper: Swapper, mover: GatedMover) -> Registration:
    """Register ``mover`` the way Registrar.register does, minus attaching memory."""
    registration = Registration(LAYOUT, [], [], mover, os.getpid())
    registrar = swapper.registrar
    await run(swapper.threads.register, swapper.staging.prepare, registration.record_bytes)
    registration.tiers = await run(swapper.threads.register, registrar._open_namespace, registration)
    registrar.namespaces[registration.namespace] = registration.tiers
    registrar.current = registration
    return registration


@pytest.mark.parametrize("release", ["unregister", "replace", "engine_exited"])
def test_release_waits_for_the_copy_holding_the_registration(tmp_path: Path, release: str) -> None:
    async def main() -> None:
        config = Config(storage_dir=str(tmp_path / "store"), cache_queue_port=0, metrics_port=0)
        swapper = Swapper(config, open_backends(config), config.locations(), Metrics())
        swapper.start()
        try:
            mover = GatedMover()
            registration = await _install(swapper, mover)
            swap = asyncio.ensure_future(swapper.swap_out([0, 1], ["a", "b"], "persisted", Deadline(10),
                                                          caller=Caller(registration.token, os.getpid())))
            while not mover.entered.is_set():
                await asyncio.sleep(0.001)
            if release == "unregister":
                releasing = asyncio.ensure_future(swapper.registrar.unregister(Caller(registration.token)))
            elif release == "replace":
                releasing = asyncio.ensure_future(swapper.registrar._release(registration, "replaced"))
            else:
                releasing = asyncio.ensure_future(swapper.registrar.release(registration, "engine_exited"))
            # The release is under way (no new leases) but waits for the copy in progress.
            done, _ = await asyncio.wait({releasing}, timeout=0.3)
            assert registration.closing and not done and not mover.closed
            mover.go.set()
            await releasing
            assert mover.closed and not mover.closed_while_copying
            assert swapper.registrar.current is None
            with pytest.raises(NotRegistered) as err:  # the copy saw the release and stopped
                await swap
            assert err.value.message == "the registration was released while this swap_out copied its blocks"
            assert err.value.details == {"copied": 0, "blocks": 2}
            assert swapper.pending_writes == 0  # nothing it copied stays in flight
            with pytest.raises(NotRegistered):
                await swapper.swap_in(["a"], [3], Deadline(5), caller=Caller(registration.token))
        finally:
            await swapper.stop()

    asyncio.run(main())


def test_a_deadline_that_passes_while_blocks_are_copied_is_a_timeout_that_says_how_far(tmp_path: Path) -> None:
    async def main() -> None:
        config = Config(storage_dir=str(tmp_path / "store"), cache_queue_port=0, metrics_port=0)
        swapper = Swapper(config, open_backends(config), config.locations(), Metrics())
        swapper.start()
        try:
            mover = GatedMover()
            registration = await _install(swapper, mover)
            deadline = Deadline(10)
            swap = asyncio.ensure_future(swapper.swap_out([0, 1], ["a", "b"], "persisted", deadline,
                                                          caller=Caller(registration.token, os.getpid())))
            while not mover.entered.is_set():
                await asyncio.sleep(0.001)
            deadline.expire()  # what the server does when a request's deadline passes
            mover.go.set()
            with pytest.raises(Timeout) as err:
                await swap
            assert err.value.message == "deadline passed while copying blocks"
            assert err.value.details == {"copied": 0, "blocks": 2}
            assert swapper.pending_writes == 0
            assert swapper.registrar.current is registration and not registration.closing  # nothing released
        finally:
            await swapper.stop()

    asyncio.run(main())


def test_a_swapper_that_never_started_stops_cleanly(tmp_path: Path) -> None:
    """A daemon that fails during start-up still stops its swapper (its pools never existed)."""
    config = Config(storage_dir=str(tmp_path / "store"), cache_queue_port=0, metrics_port=0)
    swapper = Swapper(config, open_backends(config), config.locations(), Metrics())
    asyncio.run(swapper.stop())
    assert (swapper.registration, swapper.pending_writes, swapper.stats()["write_tasks"]) == (None, 0, 0)
