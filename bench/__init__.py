"""Live benchmarks of the real system (``lanes bench overhead|fanout|connections|live``): real
processes, real Redis, many WebSocket clients; each prints a table and can write JSON and a PNG."""
