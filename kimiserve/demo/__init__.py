"""The trained demo model: its synthetic corpus (training and evaluation) and its training loop."""
