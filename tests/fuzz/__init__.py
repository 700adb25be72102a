"""Fuzzing every route of the server: hostile and malformed requests mixed with valid traffic.

- `rawhttp`: a minimal HTTP/1.1 client over plain sockets, so any byte can be sent (aiohttp's client
  refuses hostile headers and methods);
- `payloads`: hostile values and MessagePack/JSON bodies no well-behaved encoder would write
  (invalid UTF-8, deep nesting, duplicate keys, truncation), built with the plain `msgpack` package;
- `requests`: hypothesis strategies of whole requests for every route (agent, admin, views);
- `oracle`: what every reply must satisfy (no 5xx, a one-line error naming what was wrong);
- `test_fuzz_routes`: the bounded fuzz test in `make test` (in-process server, exact state checks);
- `soak` (`make fuzz`): 100,000+ requests against a real server process with a durable store, plus
  slow clients, idle connections and malformed HTTP from `socket_attacks`.
"""
