"""Standalone rendezvous server: a pure rendezvous core plus a thin aiohttp shell."""
