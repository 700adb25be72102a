"""The HTTP face of the server (aiohttp): routes, access rules, connection limits, the operator views
and page (`page/`), Prometheus metrics and the admin actions.

May import the shell (`rdzv_server.coordinator`), the core (read-only views of its records) and
`protocol`; the core and the store never import it.
"""
