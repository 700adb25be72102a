"""`python -m node_agent`: the same as the `node-agent` command."""
import sys

from node_agent.main import main

if __name__ == "__main__":
    sys.exit(main())
