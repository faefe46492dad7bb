"""A TP x PP worker group's ranks: which part of the model each holds (shard.py), what they
exchange (rank_group.py), and the pipeline leader's outcomes (outcomes.py)."""
