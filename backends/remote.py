"""The remote tier's front door: the backend a remote URL names.

``open_remote(url)`` turns ``--remote-url`` into a :class:`~kvswap.backends.base.Backend`:

- ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB][?timeout=S&connect_timeout=S&max_connections=N]``
  (``rediss://`` for TLS) — one Redis server, through redis-py;
- ``redis+cluster://[[USER]:PASSWORD@]HOST[:PORT][?...]`` (``rediss+cluster://``) — a Redis
  Cluster reached through one seed node;
- ``mooncake://MASTER_HOST:PORT[?metadata=URL&protocol=tcp|rdma&device=NAMES&segment=SIZE
  &buffer=SIZE&local_host=ADDR&slots=N&timeout=S&connect_timeout=S]`` — Mooncake Store.

Parsing is pure (:func:`~.remote_url.parse_remote_url`); a URL that is not one of these raises
:class:`RemoteConfigError` (a ``ValueError``) naming the valid forms, and so does a form whose
client package is not installed. Nothing connects until the first operation or
``backend.probe()``, so a daemon starts while its remote store is down and the tier joins when
the store comes up.

Modules: :mod:`.remote_url` parses URLs, :mod:`.remote_base` holds what both adapters share
(health gate, store base), :mod:`.redis_tier` and :mod:`.mooncake_tier` are the adapters. This
module is the only one that imports an adapter, and no adapter imports it.
"""

from __future__ import annotations

from typing import Any

from .base import Backend
from .remote_base import HealthGate, remote_key
from .remote_url import MooncakeSpec, RedisSpec, RemoteConfigError, RemoteSpec, parse_remote_url

# The tier's public names, importable from here as before the split (one definition each, in
# remote_url and remote_base).
__all__ = ["HealthGate", "MooncakeSpec", "RedisSpec", "RemoteConfigError", "RemoteSpec", "open_remote",
           "parse_remote_url", "remote_key"]


def open_remote(url: str, **options: Any) -> Backend:
    """The backend a remote URL names. Raises :class:`RemoteConfigError` (a ``ValueError``)
    for a URL that is not one of :data:`VALID_FORMS` or whose client package is missing.
    Connects lazily: see the module docstring. ``options`` go to the backend's constructor
    (``backoff_initial_s``, ``backoff_max_s``, ``clock``)."""
    spec = parse_remote_url(url)
    if isinstance(spec, RedisSpec):
        try:
            from .redis_tier import RedisBackend
        except ImportError as exc:
            raise RemoteConfigError(f"{spec.redacted()} needs the redis package "
                                    f"(pip install 'kvswap[remote]'): {exc}") from None
        return RedisBackend(spec, **options)
    from .mooncake_tier import MooncakeBackend, mooncake_import_error
    problem = mooncake_import_error()
    if problem:
        raise RemoteConfigError(f"{spec.redacted()} needs Mooncake's client "
                                f"(pip install 'kvswap[remote]'): {problem}")
    return MooncakeBackend(spec, **options)
