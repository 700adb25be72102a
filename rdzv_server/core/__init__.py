"""The pure rendezvous core: every job's rules over plain-data records. No I/O (no asyncio, aiohttp, time or
logging): every call takes `now` and hands its effects back as data (`outbox.Outbox`). Imports only `protocol` and
this package; the store, web layer and shell import it, never the other way round (tests/test_layers.py).
"""
