"""The file tier's slab layout: records in fixed-size slots of preallocated files kept open,
found again through append-only journals. One positioned write stores a record and one
positioned read loads it, where the one-file-per-record layout (:mod:`.file_store`) creates,
writes, renames and later unlinks a file per record, each a directory update.

Layout of a namespace directory::

    <root>/<namespace>/namespace.json        what the fingerprint stands for (as before)
    <root>/<namespace>/evict.lock            flock'ed by the one daemon that evicts (as before)
    <root>/<namespace>/slabs/<id>.slab       slots of round_up(header + payload, 4 KiB) bytes
    <root>/<namespace>/slabs/<id>.journal    which record is in which slot (:mod:`.slab_journal`)
    <root>/<namespace>/slabs/<id>.lock       flock'ed by the daemon that owns the slab
    <root>/<namespace>/ab/cd/<name>.kvr      records of the old layout, still read (below)

**Ownership.** A daemon owns the slabs whose lock it holds: at start-up it adopts every slab
whose owner is gone (a restart adopts its own) and makes a new one if there is none. Only the
owner writes a slab's slots and its journal, so several daemons share a directory without
racing for a slot. Every daemon reads every journal (again whenever a key is not found, and at
each maintenance pass), so what one stores the others serve.

**Atomic publish.** A put writes header and payload into a free slot, then appends a journal
entry naming the record, the slot and the slot's next generation; the index learns of it
after that. A SIGKILL before the entry leaves a slot no journal names; a torn entry fails its
checksum and is skipped; a slot is reused only after a journal says it was freed. Every read
checks the record's header (key, namespace) and payload checksum, so a slot overwritten under
a reader (another daemon freed and reused it) is a miss, never wrong data; a record that fails
its check while the journals still name it there is corrupt: counted, freed, a miss.

**Index.** A journal is replayed when the store opens (numpy over 64-byte entries: 1M records
in about three seconds on a 2-vCPU host), so the index is whole before the namespace serves; the owner rewrites
its journal down to its live entries once dead ones outnumber them. Eviction, capacity and
chains are :class:`~.file_store.FileStore`'s (this class overrides where bytes lie): evicting
appends a free entry (no unlink), the slot is reused by the owner's next write. The leader
frees records in others' slabs through its own journal; their owners reuse the slots once
they read it. Recency: puts carry their stamp, a swap_in's hit prefix appends touch entries.

**The old layout** (one file per record under ``ab/cd/``) is read as well: its files are
indexed by a background scan as before, served and evicted as files; new records go to slabs,
and a rewrite of an old record removes its file. A directory moves over as its old records
are evicted or rewritten; nothing converts it in one go.

Memory: per indexed record the index keeps its name (an 81-byte str), the index's size entry,
its chain-order stamp and heap entry, its location here and its slot's name reference: about
0.6 KB (590 B at 1M records, measured by ``benchmarks/index_scan.py``), so a million records cost ~0.6 GB.
"""

from __future__ import annotations

import errno
import heapq
import logging
import os
import secrets
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Final, Iterable, Sequence

import numpy as np

from kvswap.common.units import PAGE_BYTES
from kvswap.protocol.errors import Corrupt, NoSpace

from . import record
from . import slab_journal as journal
from .base import GetStatus
from .disk import listdir_or_empty, try_flock
from .file_layout import record_name
from .file_store import FileStore, _io_error

if TYPE_CHECKING:
    from .file_backend import FileBackend

log = logging.getLogger(__name__)

SLAB_DIR: Final = "slabs"
#: A slab grows by this much at a time (at least a few slots): fallocate is cheap, and a
#: slab that grows rarely keeps its slots contiguous on disk.
GROW_BYTES: Final = 256 << 20
MIN_GROW_SLOTS: Final = 8
#: The owner rewrites its journal once it holds this many entries more than twice its live ones.
COMPACT_SLACK: Final = 4096
#: ``_where`` value of a record stored in the old layout (a file of its own).
LEGACY: Final = -1

_SPACE_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT})
_SLOT_MASK: Final = np.uint64(0xFFFFFFFF)


def _loc(index: int, slot: int) -> int:
    return index << 32 | slot


class Slab:
    """One slab file and its journal, as this store knows them."""

    def __init__(self, sid: bytes, directory: str, index: int) -> None:
        self.id = sid
        self.index = index
        base = os.path.join(directory, sid.hex())
        self.path, self.journal_path, self.lock_path = base + ".slab", base + ".journal", base + ".lock"
        self.fd: int | None = None
        self.direct_fd: int | None = None
        self.lock_fd: int | None = None
        #: Append descriptor of the journal (owned slabs only).
        self.journal_fd: int | None = None
        #: Read descriptor of the journal, the offset read up to and the file it is.
        self.read_fd: int | None = None
        self.read_offset = 0
        self.journal_ino = 0
        self.names: list[str | None] = []
        self.gens = np.zeros(0, dtype=np.uint32)
        #: The stamp each slot's put carried: of two copies of one record, the newer is kept.
        self.put_stamps = np.zeros(0, dtype=np.int64)
        self.free: list[int] = []
        self.nslots = 0
        #: Entries in this slab's journal file (owned: when to compact).
        self.entries = 0
        self.live = 0
        #: Entries a compaction carried over beside the live puts (frees of others' slots).
        self.carried = 0
        #: The journal's size when its closed store let it go (see SlabStore._reopen).
        self.closed_at = -1

    @property
    def owned(self) -> bool:
        return self.lock_fd is not None

    def ensure(self, slots: int) -> None:
        if slots > len(self.names):
            self.names.extend([None] * (slots - len(self.names)))
        if slots > len(self.gens):
            size = max(slots, 2 * len(self.gens))
            gens = np.zeros(size, dtype=np.uint32)
            gens[: len(self.gens)] = self.gens
            stamps = np.zeros(size, dtype=np.int64)
            stamps[: len(self.put_stamps)] = self.put_stamps
            self.gens, self.put_stamps = gens, stamps

    def close(self) -> None:
        for attr in ("fd", "direct_fd", "journal_fd", "read_fd", "lock_fd"):
            fd = getattr(self, attr)
            if fd is not None:
                setattr(self, attr, None)
                try:
                    os.close(fd)
                except OSError:
                    pass


class SlabStore(FileStore):
    """A :class:`FileStore` whose records live in slab slots (see the module docstring)."""

    def __init__(self, backend: FileBackend, namespace: str, description: dict[str, Any], record_bytes: int) -> None:
        self._slabs: dict[bytes, Slab] = {}
        self._by_index: list[Slab] = []
        self._where: dict[str, int] = {}
        self._lock = threading.Lock()
        self._grow_lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._reading: Counter[int] = Counter()
        self._deferred: set[int] = set()
        self._primary: Slab | None = None
        #: Frees this daemon wrote (to its primary journal) for slots of others' slabs:
        #: ``loc -> (gen, name)``. A compaction carries them over until the owner reuses the
        #: slot, so an owner that reads them late (or restarts) still sees them.
        self._foreign_frees: dict[int, tuple[int, str]] = {}
        self._dir_mtime = 0
        self._legacy_scan_done = False
        #: Reads and writes using slab descriptors now, and whether close() waits for them.
        self._in_io = 0
        self._closing = False
        super().__init__(backend, namespace, description, record_bytes)
        # Page-aligned slots where the header is a page (records of 64 KiB and more: O_DIRECT
        # moves them in place); small records pack at 256 bytes, which O_DIRECT never takes.
        align = PAGE_BYTES if self.header_len % PAGE_BYTES == 0 else 256
        self.slot_bytes = -(-self.file_bytes // align) * align
        self.slab_dir = os.path.join(self.dir, SLAB_DIR)
        try:
            self.disk.make_dirs(self.slab_dir)
            self._open_slabs()
        except OSError as exc:
            raise _io_error(exc, "open the slab files", self.slab_dir) from None

    # -- opening: adopt, replay -----------------------------------------------------------------

    def _slab(self, sid: bytes) -> Slab:
        slab = self._slabs.get(sid)
        if slab is None:
            slab = Slab(sid, self.slab_dir, len(self._by_index))
            self._slabs[sid] = slab
            self._by_index.append(slab)
        return slab

    def _journal_ids(self) -> list[bytes]:
        ids = []
        for entry in listdir_or_empty(self.slab_dir):
            stem, dot, ext = entry.partition(".")
            if ext == "journal" and len(stem) == 8:
                try:
                    ids.append(bytes.fromhex(stem))
                except ValueError:
                    continue
        return sorted(ids)

    def _open_slabs(self) -> None:
        """Adopt the slabs nobody owns, make one if none, and replay every journal."""
        self._dir_mtime = os.stat(self.slab_dir).st_mtime_ns
        for sid in self._journal_ids():
            slab = self._slab(sid)
            slab.lock_fd = try_flock(slab.lock_path)
            if slab.owned:
                self._adopt(slab)
        owned = [s for s in self._by_index if s.owned]
        self._primary = owned[0] if owned else self._create_slab()
        for slab in list(self._by_index):
            self._open_reader(slab)
        self._load([(slab, self._read_journal(slab)) for slab in list(self._by_index)])

    def _create_slab(self) -> Slab:
        while True:
            sid = secrets.token_bytes(4)
            if sid not in self._slabs and not os.path.exists(os.path.join(self.slab_dir, sid.hex() + ".journal")):
                break
        slab = self._slab(sid)
        slab.lock_fd = try_flock(slab.lock_path)
        if slab.lock_fd is None:
            raise OSError(errno.EAGAIN, "cannot lock a new slab")
        fd = os.open(slab.journal_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
        head = journal.header_entry(sid, self.slot_bytes, self.record_bytes, self.namespace_bytes).encode()
        self.disk.append(fd, head, durable=self.disk.fsync != "none")
        slab.journal_fd = fd
        slab.entries = 1
        slab.fd, slab.direct_fd = self.disk.open_slab(slab.path, writable=True)
        log.info("new slab %s for namespace %s", sid.hex(), self.namespace)
        return slab

    def _adopt(self, slab: Slab) -> None:
        """Take over a slab whose owner is gone: cut a torn append off its journal, open it
        for writing."""
        fd = os.open(slab.journal_path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        size = os.fstat(fd).st_size
        # Only the end can be torn: look at the last entries, not the whole journal.
        start = max(0, size // journal.ENTRY_BYTES - 64) * journal.ENTRY_BYTES
        _, _, consumed = journal.decode(self.disk.read_from(fd, start))
        end = start + consumed if consumed or not start else size - size % journal.ENTRY_BYTES
        if end < size:
            os.ftruncate(fd, end)
            self._count("journal_tail_cut", 1)
        slab.journal_fd = fd
        slab.fd, slab.direct_fd = self.disk.open_slab(slab.path, writable=True)
        slab.nslots = os.fstat(slab.fd).st_size // self.slot_bytes
        self._count("slabs_adopted", 1)

    def _open_reader(self, slab: Slab) -> bool:
        try:
            fd = os.open(slab.journal_path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return False
        if slab.read_fd is not None:
            os.close(slab.read_fd)
        slab.read_fd, slab.read_offset, slab.journal_ino = fd, 0, os.fstat(fd).st_ino
        return True

    def _read_journal(self, slab: Slab) -> np.ndarray:
        """The entries of ``slab``'s journal past what was read, checked against what this
        namespace's journals must say."""
        if slab.read_fd is None:
            return np.empty(0, dtype=journal.ENTRY_DTYPE)
        data = self.disk.read_from(slab.read_fd, slab.read_offset)
        entries, damaged, consumed = journal.decode(data)
        if damaged:
            self._count("journal_damaged", damaged)
            log.warning("slab journal %s: %d damaged entries skipped", slab.journal_path, damaged)
        if slab.read_offset == 0 and len(entries):
            head = entries[0]
            if (int(head["op"]) != journal.HEADER or bytes(head["name"]) != self.namespace_bytes
                    or int(head["slot"]) != self.slot_bytes):
                log.error("slab journal %s does not describe this namespace; ignoring it", slab.journal_path)
                self._count("journal_foreign", 1)
                os.close(slab.read_fd)
                slab.read_fd = None
                return entries[:0]
        slab.read_offset += consumed
        return entries

    def _ensure_data_fd(self, slab: Slab) -> None:
        if slab.fd is None:
            slab.fd, slab.direct_fd = self.disk.open_slab(slab.path, writable=False)

    def _load(self, journals: list[tuple[Slab, np.ndarray]]) -> None:
        """Replay whole journals into an empty store: per slot, the entry of the newest
        generation decides (a put: live; a free: empty); touches of a live generation raise its
        stamp. Vectorised, so a million entries replay in about three seconds on 2 vCPUs."""
        parts = [entries for _, entries in journals if len(entries)]
        if not parts:
            return
        entries = np.concatenate(parts)
        source = np.concatenate([np.full(len(e), slab.owned, dtype=bool) for slab, e in journals if len(e)])
        body = entries["op"] != journal.HEADER
        entries, from_owned = entries[body], source[body]
        ids, inverse = np.unique(entries["slab"].view("<u4"), return_inverse=True)
        index_of = np.array([self._slab(int(sid).to_bytes(4, "little")).index for sid in ids.tolist()],
                            dtype=np.uint64)
        keys = (index_of[inverse] << np.uint64(32)) | entries["slot"].astype(np.uint64)
        op, gen, stamp = entries["op"], entries["gen"], entries["stamp"]
        placing = (op == journal.PUT) | (op == journal.FREE)
        p_keys, p_gen, p_op = keys[placing], gen[placing], op[placing]
        p_rows = np.flatnonzero(placing)
        order = np.lexsort((p_op, p_gen, p_keys))
        sorted_keys = p_keys[order]
        last = np.ones(len(order), dtype=bool)
        last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
        final = order[last]
        final_keys, final_gen, final_op = p_keys[final], p_gen[final], p_op[final]
        rows = p_rows[final]
        live = final_op == journal.PUT
        live_keys, live_gen, live_rows = final_keys[live], final_gen[live], rows[live]
        freed_here = (final_op == journal.FREE) & from_owned[rows]
        freed_names = entries["name"][rows[freed_here]].tobytes().hex()
        for i, (key, g) in enumerate(zip(final_keys[freed_here].tolist(), final_gen[freed_here].tolist())):
            if not self._by_index[key >> 32].owned:
                self._foreign_frees[key] = (g, freed_names[32 * i: 32 * i + 32])
        put_stamp = stamp[live_rows]
        live_stamp = put_stamp.copy()
        touching = op == journal.TOUCH
        if touching.any() and len(live_keys):
            t_keys, t_gen, t_stamp = keys[touching], gen[touching], stamp[touching]
            pos = np.minimum(np.searchsorted(live_keys, t_keys), len(live_keys) - 1)
            ok = (live_keys[pos] == t_keys) & (live_gen[pos] == t_gen)
            np.maximum.at(live_stamp, pos[ok], t_stamp[ok])
        slab_of, slot_of = (final_keys >> np.uint64(32)).astype(np.int64), (final_keys & _SLOT_MASK).astype(np.int64)
        live_slab, live_slot = slab_of[live], slot_of[live]
        hexes = entries["name"][live_rows].tobytes().hex()
        names = [hexes[k: k + 32] for k in range(0, len(hexes), 32)]
        name_objects = np.empty(len(names), dtype=object)
        name_objects[:] = names
        occupied: dict[int, np.ndarray] = {}
        for index in np.unique(slab_of).tolist():
            slab = self._by_index[index]
            mine, here = slab_of == index, live_slab == index
            size = max(int(slot_of[mine].max()) + 1, slab.nslots)
            slab.ensure(size)
            slab.gens[slot_of[mine]] = final_gen[mine]
            slab.put_stamps[live_slot[here]] = put_stamp[here]
            column = np.empty(len(slab.names), dtype=object)
            column[live_slot[here]] = name_objects[here]
            slab.names = column.tolist()
            occupied[index] = np.zeros(len(slab.names), dtype=bool)
            occupied[index][live_slot[here]] = True
        keys_list = live_keys.tolist()
        where = dict(zip(names, keys_list))
        losers: list[int] = []
        stamps = live_stamp.tolist()
        if len(where) == len(names):
            self._where = where
            found_names, found_stamps = names, stamps
            counts = np.bincount(live_slab, minlength=len(self._by_index))
        else:  # one record in two slots (two daemons stored one key): keep one, free the other
            where = {}
            found_names, found_stamps = [], []
            for name, key, st in zip(names, keys_list, stamps):
                held = where.get(name)
                if held is not None:
                    if self._first_wins(held, key):
                        losers.append(key)
                        continue
                    losers.append(held)
                where[name] = key
            self._where = where
            chosen = {name: st for name, key, st in zip(names, keys_list, stamps) if where[name] == key}
            found_names, found_stamps = list(chosen), list(chosen.values())
            counts = np.bincount((np.fromiter(where.values(), dtype=np.uint64, count=len(where))
                                  >> np.uint64(32)).astype(np.int64), minlength=len(self._by_index))
            for key in losers:  # not a live record here after all
                occupied[key >> 32][key & 0xFFFFFFFF] = True
        for slab in self._by_index:
            slab.live = int(counts[slab.index]) if slab.index < len(counts) else 0
            slab.entries = 0
            if slab.owned:
                slab.nslots = max(slab.nslots, len(slab.names))
                slab.ensure(slab.nslots)
                taken = np.zeros(slab.nslots, dtype=bool)
                if slab.index in occupied:
                    taken[: len(occupied[slab.index])] = occupied[slab.index][: slab.nslots]
                slab.free = np.flatnonzero(~taken).tolist()  # ascending: already a heap
        for slab, part in journals:
            slab.entries = len(part)
        self.index.load(found_names, self.slot_bytes, found_stamps)
        with self._lock:
            self._free_locked([(self._by_index[k >> 32].names[k & 0xFFFFFFFF], k) for k in losers if
                               self._by_index[k >> 32].owned], count="duplicates_dropped")

    def _first_wins(self, held: int, other: int) -> bool:
        """Two slots hold the same record (a rewrite, or two daemons stored one key): every
        daemon keeps the same one, the newer put (then the greater slab id and slot), and the
        other's owner frees it."""
        a, b = self._by_index[held >> 32], self._by_index[other >> 32]
        sa, sb = held & 0xFFFFFFFF, other & 0xFFFFFFFF
        return (int(a.put_stamps[sa]), a.id, sa) > (int(b.put_stamps[sb]), b.id, sb)

    # -- other writers: read what their journals added -----------------------------------------

    def _refresh(self) -> bool:
        """Apply what other daemons' journals say since last read (new slabs included).
        Returns whether anything was applied."""
        with self._refresh_lock:
            try:
                mtime = os.stat(self.slab_dir).st_mtime_ns
            except OSError:
                return False
            if mtime != self._dir_mtime:
                self._dir_mtime = mtime
                for sid in self._journal_ids():
                    if sid not in self._slabs or self._slabs[sid].read_fd is None and not self._slabs[sid].owned:
                        self._open_reader(self._slab(sid))
                    else:
                        self._follow_rewrite(self._slabs[sid])
            applied = False
            for slab in list(self._by_index):
                if slab.owned or slab.read_fd is None:
                    continue
                entries = self._read_journal(slab)
                if len(entries):
                    self._apply(entries)
                    applied = True
            return applied

    def _follow_rewrite(self, slab: Slab) -> None:
        """The owner rewrote its journal (compaction renames a new file in): read the old one
        to its end, then the new one from its start (its puts are known, so they change
        nothing; what follows them is new)."""
        if slab.owned or slab.read_fd is None:
            return
        try:
            ino = os.stat(slab.journal_path).st_ino
        except OSError:
            return
        if ino == slab.journal_ino:
            return
        self._apply(self._read_journal(slab))
        self._open_reader(slab)
        entries = self._read_journal(slab)
        self._apply(entries)
        # Rewrites this store did not see (two or more since it last read) took frees with
        # them: the new file's puts are the slab's live records, so a record of this slab it
        # does not name is gone.
        newest: dict[int, tuple[int, int]] = {}
        for e in entries.tolist():
            op, sid, slot, gen = e[1], e[3], e[4], e[5]
            if sid == slab.id and op in (journal.PUT, journal.FREE):
                if slot not in newest or (gen, op) > newest[slot]:
                    newest[slot] = (gen, op)
        with self._lock:
            for slot, name in enumerate(slab.names):
                if name is not None and newest.get(slot, (0, journal.FREE))[1] != journal.PUT:
                    slab.names[slot] = None
                    self._forget(name, _loc(slab.index, slot))
                    self._count("rewrite_dropped", 1)

    def _apply(self, entries: np.ndarray) -> None:
        with self._lock:
            for e in entries.tolist():
                _, op, _, sid, slot, gen, _, stamp, name, _, _ = e
                if op == journal.HEADER:
                    continue
                slab = self._slab(sid)
                if op == journal.PUT:
                    self._apply_put(slab, slot, gen, bytes(name).hex(), stamp)
                elif op == journal.FREE:
                    self._apply_free(slab, slot, gen, bytes(name).hex())

    def _apply_put(self, slab: Slab, slot: int, gen: int, name: str, stamp: int) -> None:
        slab.ensure(slot + 1)
        if gen <= slab.gens[slot]:
            return
        slab.gens[slot] = gen
        slab.put_stamps[slot] = stamp
        key = _loc(slab.index, slot)
        old = slab.names[slot]
        if old is not None:
            self._forget(old, key)
        slab.names[slot] = name
        held = self._where.get(name)
        if held is not None and held != key:
            if held == LEGACY or self._first_wins(key, held):
                self._lose(held, name)
            else:
                self._lose(key, name)
                return
        self._where[name] = key
        slab.live += 1
        self.index.add(name, self.slot_bytes, stamp)

    def _apply_free(self, slab: Slab, slot: int, gen: int, name: str) -> None:
        slab.ensure(slot + 1)
        known = int(slab.gens[slot])
        if gen < known:
            return
        if gen > known:
            # The free of a put not read yet (the freeing daemon's journal was read before
            # the owner's): that generation is over, so its put, when it comes, is ignored.
            slab.gens[slot] = gen
            old = slab.names[slot]
            if old is not None:
                slab.names[slot] = None
                self._forget(old, _loc(slab.index, slot))
            return
        if slab.names[slot] != name:
            return
        slab.names[slot] = None
        self._forget(name, _loc(slab.index, slot))
        if slab.owned:
            self._release_slot(slab, slot)

    def _forget(self, name: str, key: int) -> None:
        if self._where.get(name) == key:
            del self._where[name]
            self._by_index[key >> 32].live -= 1
            self.index.remove(name)

    def _lose(self, key: int, name: str) -> None:
        """``name``'s copy at ``key`` is not the one kept: its owner frees it (an old-layout
        file goes now)."""
        if key == LEGACY:
            self._where.pop(name, None)
            try:
                FileStore._remove_record(self, name)
            except OSError as exc:
                log.warning("cannot remove the old-layout copy of %s: %s", name, exc)
            return
        slab = self._by_index[key >> 32]
        if self._where.get(name) == key:
            del self._where[name]
            slab.live -= 1
        if slab.owned:
            self._free_locked([(name, key)], count="duplicates_dropped")

    # -- slots ----------------------------------------------------------------------------------

    def _release_slot(self, slab: Slab, slot: int) -> None:
        key = _loc(slab.index, slot)
        if self._reading.get(key):
            self._deferred.add(key)  # a read is in it: reused once the read is over
        else:
            heapq.heappush(slab.free, slot)

    def _free_slot_locked(self) -> tuple[Slab, int] | None:
        for slab in self._by_index:
            if slab.owned and slab.free:
                return slab, heapq.heappop(slab.free)
        return None

    def _take_slot(self) -> tuple[Slab, int]:
        refreshed = False
        while True:
            with self._lock:
                taken = self._free_slot_locked()
            if taken is not None:
                return taken
            if not refreshed and len(self._by_index) > 1:
                refreshed = True  # the leader may have freed slots of ours: reuse before growing
                self._refresh()
                continue
            self._grow()

    def _grow(self) -> None:
        slab = self._primary
        assert slab is not None and slab.fd is not None
        with self._grow_lock:
            with self._lock:
                if any(s.owned and s.free for s in self._by_index):
                    return
                start = slab.nslots
            # Doubling from a few slots up to GROW_BYTES a step: a small store stays small on
            # disk, a big one grows rarely. Never much past the cap, where there is one.
            step = max(MIN_GROW_SLOTS, min(start, GROW_BYTES // self.slot_bytes))
            cap_slots = self.capacity.max_bytes // self.slot_bytes
            if cap_slots:
                step = max(1, min(step, cap_slots + MIN_GROW_SLOTS - start))
            self.disk.grow(slab.fd, (start + step) * self.slot_bytes)
            with self._lock:
                slab.ensure(start + step)
                slab.nslots = start + step
                for slot in range(start, start + step):
                    heapq.heappush(slab.free, slot)
            self._count("slab_grown", 1)

    def _free_locked(self, items: Sequence[tuple[str | None, int]], count: str = "") -> None:
        """Free these records' slots: one free entry each, appended (per journal, at once) to
        the slab's own journal if this daemon owns it, else to this daemon's primary journal.
        Caller holds ``_lock``."""
        by_journal: dict[int, list[bytes]] = {}
        for name, key in items:
            if name is None:
                continue
            slab = self._by_index[key >> 32]
            slot = key & 0xFFFFFFFF
            if slab.names[slot] != name:
                continue
            entry = journal.Entry(journal.FREE, slab.id, slot, int(slab.gens[slot]), 0, bytes.fromhex(name))
            target = slab if slab.owned else self._primary
            assert target is not None
            by_journal.setdefault(target.index, []).append(entry.encode())
            if target is not slab:
                self._foreign_frees[key] = (int(slab.gens[slot]), name)
            slab.names[slot] = None
            if self._where.get(name) == key:
                del self._where[name]
                slab.live -= 1
            if slab.owned:
                self._release_slot(slab, slot)
            if count:
                self._count(count, 1)
        for index, encoded in by_journal.items():
            target = self._by_index[index]
            if target.journal_fd is None:
                continue  # the store is closed: the slots stay named, a later owner frees them
            self.disk.append(target.journal_fd, b"".join(encoded), durable=self.disk.fsync == "strict")
            target.entries += len(encoded)

    # -- where records lie (FileStore's hooks) ----------------------------------------------------

    def _write_record(self, name: str, header: memoryview | bytes, payload: memoryview, stamp: int) -> int:
        # The slot's write and its journal entry are an I/O section (close() waits for them).
        # Entering it takes a free slot under the same lock, and _publish leaves it under the
        # lock it publishes with: per record, two acquisitions of the store's lock fewer, each
        # a possible hand-off between the write threads (perf: futex wake-ups and switches were
        # a fifth of the daemon's CPU under a persisted stream).
        try:
            taken = self._enter_write()
        except OSError as exc:
            raise _io_error(exc, "write a record", self.slab_dir) from None
        try:
            for attempt in (1, 2):
                if taken is not None:
                    break
                try:
                    taken = self._take_slot()
                except OSError as exc:
                    if exc.errno in _SPACE_ERRNOS and attempt == 1 and self.is_leader:
                        self._count("enospc_retries", 1)
                        if self.evict(2 * self.slot_bytes, "enospc"):
                            continue
                    raise _io_error(exc, "grow a slab", self.slab_dir) from None
        except BaseException:
            with self._lock:
                self._leave_io_locked()
            raise
        assert taken is not None
        return self._publish(*taken, name, header, payload, stamp)

    def _publish(self, slab: Slab, slot: int, name: str, header: memoryview | bytes, payload: memoryview,
                 stamp: int) -> int:
        """Write the record into ``slot`` and publish it (its journal entry, the slot's name),
        then leave the I/O section :meth:`_enter_write` entered, on every path."""
        assert slab.fd is not None
        try:
            self.disk.write_at(slab.fd, slab.direct_fd, [header, payload], slot * self.slot_bytes)
        except BaseException as exc:
            with self._lock:
                self._release_slot(slab, slot)
                self._leave_io_locked()
            if isinstance(exc, OSError):
                raise _io_error(exc, "write a record", slab.path) from None
            raise
        key = _loc(slab.index, slot)
        with self._lock:
            try:
                gen = int(slab.gens[slot]) + 1
                entry = journal.Entry(journal.PUT, slab.id, slot, gen, stamp, bytes.fromhex(name)).encode()
                assert slab.journal_fd is not None
                try:
                    self.disk.append(slab.journal_fd, entry, durable=self.disk.fsync == "strict")
                except OSError as exc:
                    self._release_slot(slab, slot)
                    raise _io_error(exc, "write a journal entry", slab.journal_path) from None
                slab.entries += 1
                slab.gens[slot] = gen
                slab.put_stamps[slot] = stamp
                slab.names[slot] = name
                held = self._where.get(name)
                if held is not None and held != key:
                    if held != LEGACY and self._first_wins(held, key):
                        self._lose(key, name)  # another daemon's newer copy stays
                        return self.slot_bytes
                    self._lose(held, name)
                self._where[name] = key
                slab.live += 1
                if not self._closing and self._compaction_due(slab):
                    self._compact_locked(slab)
            finally:
                self._leave_io_locked()  # whatever happened: a section left open, close() never closes
        return self.slot_bytes

    def _remove_record(self, name: str) -> bool:
        with self._lock:
            key = self._where.get(name)
            if key is None:
                return False
            if key != LEGACY:
                self._free_locked([(name, key)])
                return True
            del self._where[name]
        return FileStore._remove_record(self, name)

    def _persist_stamps(self, touched: Sequence[tuple[str, int]]) -> None:
        with self._lock:
            by_journal: dict[int, list[bytes]] = {}
            for name, stamp in touched:
                key = self._where.get(name)
                if key is None or key == LEGACY:
                    continue
                slab = self._by_index[key >> 32]
                slot = key & 0xFFFFFFFF
                target = slab if slab.owned else self._primary
                assert target is not None
                entry = journal.Entry(journal.TOUCH, slab.id, slot, int(slab.gens[slot]), stamp, bytes.fromhex(name))
                by_journal.setdefault(target.index, []).append(entry.encode())
            for index, encoded in by_journal.items():
                target = self._by_index[index]
                if target.journal_fd is None:
                    continue
                try:
                    self.disk.append(target.journal_fd, b"".join(encoded), durable=False)
                except OSError:
                    continue  # recency on disk is a hint
                target.entries += len(encoded)
        legacy = [(n, s) for n, s in touched if self._where.get(n) == LEGACY]
        if legacy:
            super()._persist_stamps(legacy)

    def _location(self, name: str) -> str:
        key = self._where.get(name)
        if key is None or key == LEGACY:
            return self._path(name)
        return f"{self._by_index[key >> 32].path}#{key & 0xFFFFFFFF}"

    def _read_header(self, name: str) -> bytes:
        key = self._where.get(name)
        if key is None or key == LEGACY:
            return super()._read_header(name)
        slab = self._by_index[key >> 32]
        self._ensure_data_fd(slab)
        assert slab.fd is not None
        return os.pread(slab.fd, self.header_len, (key & 0xFFFFFFFF) * self.slot_bytes)

    def _rescan(self) -> None:
        self._refresh()
        self._maybe_compact_all()

    # -- Store --------------------------------------------------------------------------------------

    def put(self, key: str, payload: memoryview) -> int:
        size = super().put(key, payload)
        name = record_name(key)
        with self._lock:
            if name not in self._where:
                # Freed by another daemon's journal between the write and the index learning of
                # it (an eviction that fast): the index must not keep what the slots lost.
                self.index.remove(name)
                self._count("freed_while_written", 1)
        return size

    def get_into(self, key: str, out: memoryview) -> GetStatus:
        if len(out) != self.record_bytes:
            raise ValueError(f"output buffer of {len(out)} bytes, records hold {self.record_bytes}")
        name = record_name(key)
        with self._lock:
            where = self._where.get(name)
        if where is None:
            # contains reads the other daemons' journals and, until the old layout's scan ends,
            # looks for its file: once, where this read did both before.
            if not self.contains(key):
                return GetStatus.MISS
            with self._lock:
                where = self._where.get(name)
            if where is None:
                return GetStatus.MISS
        if where == LEGACY:
            return super().get_into(key, out)
        slab = self._by_index[where >> 32]
        slot = where & 0xFFFFFFFF
        header_buf = self._header_buffer("read") if self.disk.direct else bytearray(self.header_len)
        with self._lock:  # the read's I/O section starts here and ends in the same lock as _reading's count
            if self._where.get(name) != where:
                return GetStatus.MISS
            gen = int(slab.gens[slot])
            self._reading[where] += 1
            self._in_io += 1
        self.index.pin(name)
        try:
            try:
                self._ensure_data_fd(slab)
                assert slab.fd is not None
                n = self.disk.read_at(slab.fd, slab.direct_fd, [header_buf, out], slot * self.slot_bytes)
            except OSError as exc:
                raise _io_error(exc, "read a record", slab.path) from None
            try:
                if n != self.file_bytes:
                    raise Corrupt("record has the wrong size", size=n, expected=self.file_bytes)
                header = record.decode_header(memoryview(header_buf))
                record.verify(header, self.namespace_bytes, key, out)
            except Corrupt as exc:
                return self._failed_check(name, key, slab, slot, gen, exc)
        finally:
            self.index.unpin(name)
            with self._lock:
                self._reading[where] -= 1
                if self._reading[where] <= 0:
                    del self._reading[where]
                    if where in self._deferred:
                        self._deferred.discard(where)
                        heapq.heappush(slab.free, slot)
                self._leave_io_locked()  # last: it may close the slabs (a closed store's last I/O)
        self.index.touch(name)
        return GetStatus.LOADED

    def _failed_check(self, name: str, key: str, slab: Slab, slot: int, gen: int, exc: Corrupt) -> GetStatus:
        """A record that failed its check: if its slot was freed and reused meanwhile (another
        daemon's eviction), a miss; if the journals still say it is there, corrupt."""
        if not slab.owned:
            self._refresh()
        with self._lock:
            still = self._where.get(name) == _loc(slab.index, slot) and int(slab.gens[slot]) == gen
        if not still:
            self._count("slot_reused_under_read", 1)
            return GetStatus.MISS
        log.warning("corrupt record %s#%d for key %s: %s; removing it", slab.path, slot, key, exc.message)
        self._count("corrupt", 1)
        self._discard(name)
        return GetStatus.CORRUPT

    def contains(self, key: str) -> bool:
        name = record_name(key)
        if name in self.index:
            return True
        if self._refresh() and name in self.index:
            return True
        if not self._legacy_scan_done and self.disk.exists(self._path(name)):
            # Until the old layout's scan ends, one stat finds its records.
            with self._lock:
                self._where.setdefault(name, LEGACY)
            self.index.add(name, self.file_bytes, key=key)
            return True
        return False

    def delete(self, key: str) -> bool:
        with self._lock:
            known = record_name(key) in self._where
        if not known:
            # Another daemon's record this one has not read of yet, or an old-layout file the
            # start-up scan has not reached: contains indexes either, so it is removed, not
            # indexed again by the scan after this delete answered.
            self.contains(key)
        return super().delete(key)

    def clear(self) -> int:
        with self._lock:
            items = [(name, key) for name, key in self._where.items() if key != LEGACY]
            legacy = [name for name, key in self._where.items() if key == LEGACY]
            self._free_locked(items)
            for name in legacy:
                self._where.pop(name, None)
        removed = len(items)
        for name in legacy:
            try:
                removed += FileStore._remove_record(self, name)
            except OSError as exc:
                log.warning("cannot remove %s: %s", self._path(name), exc)
        self.index.clear()
        self._maybe_compact_all()
        return removed

    def usage(self) -> dict[str, int]:
        return {"records": len(self.index), "bytes": self.index.bytes}

    def close(self) -> None:
        """Give up the eviction lock for good, and the slabs (descriptors, locks: a restart or
        another daemon may adopt them) once no write is in one: never under a write (closing
        under one made it fail with EBADF, or write into whatever file reused the number). A
        write the daemon queued before it closed the store takes its slab back for that write
        if nobody adopted it meanwhile (:meth:`_reopen`)."""
        super().close()
        with self._lock:
            self._closing = True
            if not self._in_io:
                self._close_owned()

    def _close_owned(self) -> None:
        for slab in self._by_index:
            if slab.journal_fd is not None:
                slab.closed_at = os.fstat(slab.journal_fd).st_size
            slab.close()

    def _reopen(self) -> None:
        """(closed store, under ``_lock``) Take the primary slab back for one more write: only
        if its lock is free and its journal is as this store left it."""
        slab = self._primary
        assert slab is not None
        if slab.owned:
            return
        fd = try_flock(slab.lock_path)
        if fd is None:
            raise OSError(errno.EBADF, "the store is closed and its slab was adopted")
        try:
            journal_fd = os.open(slab.journal_path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            os.close(fd)
            raise
        if os.fstat(journal_fd).st_size != slab.closed_at:
            os.close(journal_fd)
            os.close(fd)
            raise OSError(errno.EBADF, "the store is closed and its slab changed since")
        slab.lock_fd, slab.journal_fd = fd, journal_fd
        slab.fd, slab.direct_fd = self.disk.open_slab(slab.path, writable=True)

    def _enter_write(self) -> tuple[Slab, int] | None:
        """Enter a record write's I/O section (a closed store takes its primary slab back for
        it, :meth:`_reopen`) and, under the same lock, take a free slot of ours where one is at
        hand (None: :meth:`_take_slot` finds or grows one). Reads enter theirs in
        :meth:`get_into` (a closed store reads through a read-only descriptor)."""
        with self._lock:
            if self._closing:
                self._reopen()
            self._in_io += 1
            return self._free_slot_locked()

    def _leave_io_locked(self) -> None:
        """(under ``_lock``) The end of an I/O section: the last one of a closed store lets go
        of its slabs."""
        self._in_io -= 1
        if self._closing and not self._in_io:
            self._close_owned()

    def free_bytes(self) -> int | None:
        """Free bytes for records: the file system's plus this daemon's free slots (slab files
        never shrink, so evicting frees slots, not blocks)."""
        free = super().free_bytes()
        if free is None:
            return None
        with self._lock:
            return free + sum(len(s.free) for s in self._by_index if s.owned) * self.slot_bytes

    # -- start-up: the old layout's files --------------------------------------------------------

    def scan(self) -> int:
        """The journals were replayed when the store opened; this indexes records of the old
        layout (one file each), which take a directory walk, and reclaims dead writers' temp
        files. Returns the records indexed in all."""
        if self._closed:
            return 0
        started = time.monotonic()
        self._count("temp_reclaimed", _reclaim(self))
        legacy = [(n, size, mtime) for n, size, mtime in self._list_records(stop_if_closed=True)
                  if n not in self._where]
        if self._closed:
            return len(self.index)
        with self._lock:
            for name, _, _ in legacy:
                self._where.setdefault(name, LEGACY)
        if legacy:
            self._learn_keys(legacy)
            self.index.merge_scanned(legacy)
            self._count("legacy_records", len(legacy))
        if self.events.enabled:
            replayed = [name for name, key in list(self._where.items()) if key != LEGACY]
            self._learn_keys([(name, self.slot_bytes, 0) for name in replayed])
            # The journals were replayed when the store opened, before it was watched: announce
            # those records now that their keys are known (the old layout's went in merge_scanned).
            self.entered(replayed)
        self._legacy_scan_done = True
        self.scan_seconds = time.monotonic() - started
        self._last_rescan = time.monotonic()
        self.scan_complete.set()
        self.try_lead()
        return len(self.index)

    def _maybe_compact_all(self) -> None:
        for slab in list(self._by_index):
            if slab.owned:
                self._maybe_compact(slab)

    def _maybe_compact(self, slab: Slab) -> None:
        if not self._compaction_due(slab):
            return
        with self._lock:
            if self._compaction_due(slab):
                self._compact_locked(slab)

    @staticmethod
    def _compaction_due(slab: Slab) -> bool:
        return slab.entries > 2 * slab.live + slab.carried + COMPACT_SLACK

    def _compact_locked(self, slab: Slab) -> None:
        """Rewrite ``slab``'s journal to its header and one put per live slot (with its current
        stamp), then rename it over the old one. Readers finish the old file first (they hold
        it open), then read the new one."""
        tmp = f"{slab.journal_path}.{secrets.token_hex(4)}.tmp"
        encoded = [journal.header_entry(slab.id, self.slot_bytes, self.record_bytes, self.namespace_bytes).encode()]
        for slot, name in enumerate(slab.names):
            if name is None or self._where.get(name) != _loc(slab.index, slot):
                continue
            stamp = self.index.stamp(name) or 0
            encoded.append(journal.Entry(journal.PUT, slab.id, slot, int(slab.gens[slot]), stamp,
                                         bytes.fromhex(name)).encode())
        carried = 0
        if slab is self._primary:
            for key, (gen, name) in list(self._foreign_frees.items()):
                other, slot = self._by_index[key >> 32], key & 0xFFFFFFFF
                if other.owned or int(other.gens[slot]) != gen or other.names[slot] is not None:
                    del self._foreign_frees[key]  # the owner reused the slot: the free was read
                    continue
                encoded.append(journal.Entry(journal.FREE, other.id, slot, gen, 0, bytes.fromhex(name)).encode())
                carried += 1
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            log.warning("cannot compact %s: %s", slab.journal_path, exc)
            return
        try:
            self.disk.append(fd, b"".join(encoded), durable=self.disk.fsync != "none")
            os.rename(tmp, slab.journal_path)
        except OSError as exc:
            os.close(fd)
            self.disk.remove(tmp)
            log.warning("cannot compact %s: %s", slab.journal_path, exc)
            return
        if self.disk.fsync == "strict":
            self.disk.sync_dir(self.slab_dir)
        old, slab.journal_fd = slab.journal_fd, fd
        if old is not None:
            os.close(old)
        slab.entries, slab.carried = len(encoded), carried
        self._count("journal_compactions", 1)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        with self._lock:
            out.update({"layout": "slab", "slabs": len(self._by_index),
                        "slabs_owned": sum(1 for s in self._by_index if s.owned),
                        "free_slots": sum(len(s.free) for s in self._by_index if s.owned),
                        "slot_bytes": self.slot_bytes})
        return out


def _reclaim(store: SlabStore) -> int:
    from .file_layout import reclaim_temp_files

    return reclaim_temp_files(store.tmp_dir, store.backend.instance, store.disk)

