"""The gateway's side of a cluster: the engine client (client.py) and the tokenizer
role's client (tokenizer_client.py).

ClusterEngineClient composes three objects, one concern each: the replica set
(replica_set.py: the schedulers the registry lists, their health and load, and which
of our requests each runs), placement (placement.py: which replica takes a request,
by routing.py's policy over kv_index.py's prefix index) and the request streams
(streams.py: submit through submit_batcher.py, deltas from nats_subscriber.py, replay
of what NATS lost, abort), with migration.py resubmitting a request whose replica died.
"""
