"""Cooperative minibatching across processes (cooperative paper §3.1, Alg. 1): vertex ownership and the
all-to-all exchanges of sampled ids, features and embeddings."""
