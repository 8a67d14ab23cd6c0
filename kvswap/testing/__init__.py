"""Helpers the tests and the benchmarks share: a real kvswapd as a subprocess, the crash
harness, the load driver, real remote stores on loopback, the protocol fuzzer.

They are in the package so that benchmarks import them by name instead of putting tests/ on
``sys.path``; pytest's fixtures and plugins stay in tests/. Nothing else of kvswap imports
this package (tests/test_import_graph.py), and some of its modules need the test extra
(``pip install -e .[test]``: hypothesis for :mod:`.fuzz_frames`, redis for
:mod:`.remote_servers`' Redis servers).

- :mod:`.daemon_process`: ``DaemonProcess``, one kvswapd on loopback with a real directory;
- :mod:`.polling`: ``wait_until``;
- :mod:`.skips`: how a skip for a component ``scripts/test.sh`` installs is worded;
- :mod:`.crash_harness`, :mod:`.load_driver`, :mod:`.remote_servers`, :mod:`.fuzz_frames`.
"""
