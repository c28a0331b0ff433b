"""The web console (``timerwheel console``) and the terminal view (``timerwheel top``).

What an operator of timerwheel looks at, built only from what the installation already offers:

- the stages' own ``/metrics`` (``scrape``): per shard W, R, owners and epochs, input wait; the
  scheduled / delivered / cancelled / dead-lettered counters, whose rates the console derives
  from successive scrapes (``overview.Sampler``); the lateness histogram; the load ahead;
- the shards on the data volume, opened read-only (``browse``, ``overview``): the pending timers
  by time range, destination and id, and what is due in the next minutes and hours, counted from
  the wheel (``Shard.count_range``, as the stages' ``due_peak_per_s`` is);
- the commit log: the pending messages' timer records (key, headers, value) and the dead-letter
  topic.

Actions go through the public wire contract only (``actions``): a cancel is a ``tw-cancel``
record, a reschedule one record that replaces the ticket (``TimerClient.reschedule``; later times
only), "deliver now" a copy due now and a cancel (``TimerClient.deliver_now``),
a redrive a new timer record built from the dead letter. So the pipeline's guarantees (never early,
at least once, a cancel acknowledged before the delivery time meets its message) stay its own.

The web side (``app``) is a Starlette application with Jinja2 templates served by uvicorn; its
charts are uPlot, vendored from npm at build time (``scripts/assets.sh``). It is read-only unless
an action token is configured; see ``docs/console.md``.
"""
