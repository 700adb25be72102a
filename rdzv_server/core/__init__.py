"""The pure rendezvous core: every job's rules (admission, rounds, leases, restarts, spares,
exclusions, operator actions) over plain-data records.

No I/O: nothing here imports asyncio, aiohttp, time or logging. Every call takes `now` and hands
its effects back as data (`outbox.Outbox`). May import `protocol` and this package only; the store,
the web layer and the shell import it, never the other way round (tests/test_layers.py).
"""
