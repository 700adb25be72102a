"""`node-agent`'s command line: flags and PET_* variables (`flags`), their values (`values`), the
settings they make (`options`), the launch form torchrun would pick (`launch_form`), the job's identity and
`--rdzv-conf` (shared with the plugin). May import `protocol` and `node_agent.settings`; node_agent/main.py composes."""
