"""The kopf operator of timerwheel: reconciles a ``TimerWheel`` (``timerwheel.io/v1alpha1``) into
the volume claim, the ``TW_*`` ConfigMap, one workload, Service and PodDisruptionBudget per stage
and a ServiceAccount, and reports per-shard progress read from the stages' own ``/metrics``.

Layout (crate-operator's): ``main`` registers the handlers and sets kopf's settings in one
startup hook; ``handlers/`` holds thin, idempotent handlers; the domain modules build plain
manifests (``manifests``), read the spec (``spec``), define the CRD (``crd``), parse the stages'
metrics (``metrics``) and compute status (``status``). Only ``kube`` talks to the API server.
"""

GROUP = "timerwheel.io"
VERSION = "v1alpha1"
PLURAL = "timerwheels"
KIND = "TimerWheel"
FIELD_MANAGER = "timerwheel-operator"
