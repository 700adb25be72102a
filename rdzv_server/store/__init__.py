"""Durable state: the store interface (`api`), SQLite under --state-dir (`sqlite`), the group commit
between the event loop and a store (`persistence`), the rows a commit writes (`snapshots`), and the
replicated store on etcd with its leader election (`etcd/`).

May import `protocol`, the core (the records it saves) and this package; never the web layer or the
shell.
"""
