"""`node-agent`'s command line: every torchrun flag and PET_* variable (`flags`), their values
(`values`), one frozen `AgentOptions` (`options`) split into the parts' settings (node_agent/settings.py),
the launch form torchrun would pick (`launch_form`), the job's identity and `--rdzv-conf` (shared with
the plugin). May import `protocol` and `node_agent.settings`; the composition root is node_agent/main.py.
"""
