"""The production commit log on Apache Kafka, through kafka-python; a module per job:

- ``log``: ``KafkaCommitLog``, the facade the stages use (``CommitLog`` and its capabilities);
- ``producer``: appends, per-record outcome, metadata of new topics asked together, transactions;
- ``reader``: random reads by position, served from the read cache first (dequeue-getmsg);
- ``follower``: the thread that reads a topic ahead into the read cache;
- ``consumers``: consumers from the caller's offsets (enqueue-get) and group members (retry);
- ``admin``: topics, partition counts, retention;
- ``clients``: the connection settings and the factory of every kafka-python client;
- ``codecs``: the check that every compression codec can be decoded here;
- ``access``: the check that the broker accepts this client's TLS and SASL settings;
- ``errors``: ``KafkaLogError`` and the mapping of kafka-python's errors;
- ``internals``: the few reaches below kafka-python's public API, each with its reason.
"""
