"""The embedded mode's commit log on local files, Kafka's interface; a module per job:

- ``log``: ``LocalCommitLog``, topics, appends, reads, retention;
- ``segments``: one partition's segment files (dense offsets, torn tails, recovery, retention);
- ``frames``: how a record is encoded in a segment (CRC-checked msgpack frames);
- ``consumers``: consumers from the caller's offsets and the one member of a consumer group;
- ``partitioner``: Kafka's default partitioner, bit for bit;
- ``layout``: the directory, its names and their rule.
"""
