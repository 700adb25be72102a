"""Durable state: the store interface (`api`), SQLite under --state-dir (`sqlite`), the group commit (`persistence`),
the rows a commit writes (`snapshots`), and replicas on etcd with leader election (`etcd/`).
May import `protocol`, the core and this package; never the web layer or the shell.
"""
