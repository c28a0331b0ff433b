"""Running the stages: the wiring both modes share, the embedded runtime, the stage process.

    wiring.py    Transports (local or Kafka + Redis) and ``build_stage``: a stage from the configuration
    runner.py    StageRunner (a stage's loop that never dies), Heartbeat, the interpreter's settings
    embedded.py  EmbeddedTimerwheel: all five stages in threads of one process
    process.py   ``timerwheel stage NAME`` and ``timerwheel run``: a process, its signals, its HTTP server
    health.py    /healthz, /readyz and /metrics
    inspect.py   what a process tells about its shards: ``inspect``, the gauges, ``due_peak_per_s``
    disaster.py  ``timerwheel recover-from-kafka``: the shards of a lost volume made again from Kafka

The store and the stages know nothing of these: they take the interfaces built here.
"""
