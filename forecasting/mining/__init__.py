"""Mining: prompts -> block paths through a prefix tree (``prefix_tree``, ``block_paths``),
near-duplicate families (``families``, MinHash LSH), and demand tables for forecasting (``demand``)."""
