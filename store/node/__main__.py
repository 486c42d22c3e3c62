"""``python -m store.node``: the node process (what ``prefill node`` runs)."""
import sys

from store.node.cli import main

if __name__ == "__main__":  # importing the module (the error catalogue's walk, docs) runs nothing
    sys.exit(main())
