"""The data a run reads: its section of the config, the shards as windows and rows, single sources and weighted mixtures, the training loader."""
