"""The kvwarm node process: one per machine, it owns the store, and every engine hands it write-back through a shared-memory ring."""
