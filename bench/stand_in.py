"""One stand-in engine (the tests' quart-trio app that answers at once) in a process of its
own, for ``bench/proxy_overhead.py``: it prints its URL on a line of its own, then serves until
terminated.

    python bench/stand_in.py NAME [--engine-id ID] [--certfile PEM --keyfile PEM]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.test_proxy import FakeEngine, serve_fake


async def main(args: argparse.Namespace) -> None:
    logging.disable(logging.INFO)
    tls = (args.certfile, args.keyfile) if args.certfile else None
    engine = FakeEngine(args.name, engine_id=args.engine_id, tls=tls)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_fake, engine)
        print(url, flush=True)
        while True:  # what it received is of no use here: keep its memory flat
            await trio.sleep(1)
            engine.received.clear()
            engine.dp_ranks_seen.clear()
            engine.auth_seen.clear()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("name")
    ap.add_argument("--engine-id", default="")
    ap.add_argument("--certfile")
    ap.add_argument("--keyfile")
    trio.run(main, ap.parse_args())
