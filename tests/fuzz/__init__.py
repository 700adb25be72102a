"""Fuzzing every route of the server: hostile and malformed requests mixed with valid traffic.

- `rawhttp`: a minimal HTTP/1.1 client over plain sockets, so any byte can be sent (aiohttp's client
  refuses hostile headers and methods);
- `payloads`: hostile values and MessagePack/JSON bodies no well-behaved encoder would write
  (invalid UTF-8, deep nesting, duplicate keys, truncation), built with the plain `msgpack` package;
- `requests`, `operator_requests`: hypothesis strategies of whole requests for every route;
- `oracle`: what every reply must satisfy (no 5xx, a one-line error naming what was wrong);
- `known_issues`: open findings (reproducers in `test_findings`, xfail strict) set aside meanwhile;
- `test_fuzz_routes`: the bounded fuzz test in `make test` (in-process server, exact state checks);
- `soak` (`make fuzz`): 100,000+ requests from `soak_client` processes against a real server with a
  durable store, plus malformed HTTP, slow and idle clients (`socket_attacks`) and well-behaved
  traffic that must not notice (`live_traffic`).
"""
