"""Prepared training data: a corpus tokenized once into memory-mappable shards (see format.py)."""
