"""``python -m kvswap.daemon`` is ``kvswapd``."""

from .cli import main

main(prog_name="kvswapd")
