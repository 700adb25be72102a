"""The HTTP face of the server (aiohttp): the app and its routes, who may call what (`access`),
connection limits, the operator views (JSON), the status page (`page/`), Prometheus metrics and the
admin actions.

May import the shell (`rdzv_server.coordinator`), the core (read-only views of its records) and
`protocol`; the core and the store never import it.
"""
