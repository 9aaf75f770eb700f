"""Graph data on the host: the graph (CSC), its blocks and batches, and the feature store."""
