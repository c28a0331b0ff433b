"""kopf handlers: thin and idempotent, each calls ``reconcile``. Importing this package
registers them (``main`` does)."""
