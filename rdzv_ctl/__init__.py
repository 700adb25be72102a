"""`rdzv-ctl`: an operator's command-line client of the server's views and admin routes. A client like any
other: it imports `protocol` and the standard library only, never the server."""
