"""Sans-IO protocol layer: pure state machines and planners (no trio, sockets, threads, clocks)."""
