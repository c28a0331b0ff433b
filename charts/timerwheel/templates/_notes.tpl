{{- /* What `helm install` prints (NOTES.txt), defined here so that tests can render it with `helm template`. */ -}}
{{- define "timerwheel.notes" -}}
timerwheel {{ .Chart.AppVersion }} is installed in namespace {{ .Release.Namespace }}.
{{- if .Values.timerwheel.create }}
{{- $spec := .Values.timerwheel.spec }}
{{- $dest := include "timerwheel.exampleTopic" . }}
{{- $image := include "timerwheel.image" . }}

The operator turns the TimerWheel "{{ include "timerwheel.wheelName" . }}" into five stage workloads.
Wait for it to be Ready (if it is not, its conditions say why: kubectl describe timerwheel):

  kubectl -n {{ .Release.Namespace }} wait timerwheel/{{ include "timerwheel.wheelName" . }} --for=condition=Ready --timeout=5m
  kubectl -n {{ .Release.Namespace }} get timerwheel {{ include "timerwheel.wheelName" . }}

Schedule a first message: write a record to the timer topic "{{ $spec.timerTopic | default "__timer" }}" with the header
tw-topic (its destination, which timerwheel.spec.allowTopics must allow) and one of tw-delay-ms /
tw-deliver-at (epoch ms) / tw-delay-level, from any Kafka client. With the image's CLI, from inside
the cluster:

  kubectl -n {{ .Release.Namespace }} run tw-hello --rm -i --restart=Never --image={{ $image }} \
    --image-pull-policy={{ .Values.image.pullPolicy }} {{- with .Values.imagePullSecrets }} --overrides='{"spec":{"imagePullSecrets":{{ toJson . }}}}'{{ end }} \
    --command -- timerwheel schedule --kafka {{ $spec.kafka.bootstrap }} \
    --timer-topic {{ $spec.timerTopic | default "__timer" }} --topic {{ $dest | default "DESTINATION" }} --delay-ms 5s --value hello
{{- if not $dest }}

  (DESTINATION: a topic timerwheel.spec.allowTopics allows; none of its patterns could be
  checked here.)
{{- end }}
{{- if or $spec.kafka.securityProtocol $spec.kafka.secretName }}

  (Kafka with TLS / SASL: the command also needs the client settings the stages get,
  TW_KAFKA_SECURITY_PROTOCOL and the rest: docs/helm.md, "A first message".)
{{- end }}

Five seconds later it is on the topic "{{ $dest | default "DESTINATION" }}", with the header tw-delivered-at:

  kubectl -n {{ .Release.Namespace }} run tw-read --rm -i --restart=Never --image={{ $image }} \
    --image-pull-policy={{ .Values.image.pullPolicy }} {{- with .Values.imagePullSecrets }} --overrides='{"spec":{"imagePullSecrets":{{ toJson . }}}}'{{ end }} \
    --command -- timerwheel consume --kafka {{ $spec.kafka.bootstrap }} --topic {{ $dest | default "DESTINATION" }} --follow
{{- end }}
{{- if .Values.tests.enabled }}

Check the whole path (schedule through Kafka, wait for the delivery): helm test {{ .Release.Name }} -n {{ .Release.Namespace }}
(a test that passed leaves nothing behind; a failed one keeps its Job a day for its log:
kubectl -n {{ .Release.Namespace }} logs job/{{ printf "%s-test-delivery" (include "timerwheel.fullname" .) | trunc 63 | trimSuffix "-" }})
{{- end }}

The CRD and the TimerWheel's volume claim stay after `helm uninstall` (they hold pending timers).
{{- end -}}
