"""``python -m store.node``: the node process (what ``prefill node`` runs)."""
import sys

from store.node.cli import main

sys.exit(main())
