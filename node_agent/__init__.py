"""Thin per-node agent: joins a job, long-polls the server, spawns and supervises local workers."""
