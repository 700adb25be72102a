"""`node-agent`'s command line: every torchrun flag and PET_* variable (`flags`), their values
(`values`), one frozen `AgentOptions` (`options`), the launch form torchrun would pick
(`launch_form`), the job's identity and `--rdzv-conf` (shared with the plugin), and `main`.
"""
