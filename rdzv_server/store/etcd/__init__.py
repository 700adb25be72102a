"""Replicas on etcd (`--store etcd://...`): the v3 JSON-gateway client, the store on it, the
leader election with fenced commits, and the etcd flags. Imports the store layer and the core only.
"""
