{{/* Chart name, truncated to a DNS label. */}}
{{- define "timerwheel.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Fully qualified name of the chart's own objects (the operator). Never "tw-...": Kubernetes turns a
Service name into <NAME>_SERVICE_HOST variables, and TW_* are timerwheel's settings.
*/}}
{{- define "timerwheel.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "timerwheel.operatorName" -}}
{{- printf "%s-operator" (include "timerwheel.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Name of the TimerWheel the chart makes: timerwheel.name, else the release name. */}}
{{- define "timerwheel.wheelName" -}}
{{- default .Release.Name .Values.timerwheel.name | trunc 28 | trimSuffix "-" -}}
{{- end -}}

{{- define "timerwheel.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "timerwheel.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "timerwheel.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: timerwheel
{{- end -}}

{{- define "timerwheel.operatorSelector" -}}
app.kubernetes.io/name: {{ include "timerwheel.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "timerwheel.serviceAccountName" -}}
{{- default (include "timerwheel.operatorName" .) .Values.operator.serviceAccount.name -}}
{{- end -}}

{{/* The names of imagePullSecrets, comma-separated (the operator's TIMERWHEEL_IMAGE_PULL_SECRETS). */}}
{{- define "timerwheel.pullSecretNames" -}}
{{- $names := list -}}
{{- range .Values.imagePullSecrets -}}{{- $names = append $names .name -}}{{- end -}}
{{- join "," $names -}}
{{- end -}}

{{/*
A destination for the first message NOTES.txt prints, that timerwheel.spec.allowTopics allows:
tests.topic when a pattern matches it (the default pattern "(?!__).+" is checked by hand: Go's
regular expressions have no look-ahead), else a pattern that is a plain topic name; empty when
none can be checked here.
*/}}
{{- define "timerwheel.exampleTopic" -}}
{{- $candidate := .Values.tests.topic | default "timerwheel-helm-test" -}}
{{- $patterns := .Values.timerwheel.spec.allowTopics | default (list "(?!__).+") -}}
{{- $found := "" -}}
{{- range $patterns -}}
{{- if and (not $found) (or (and (eq . "(?!__).+") (not (hasPrefix "__" $candidate))) (regexMatch (printf "^(?:%s)$" .) $candidate)) -}}
{{- $found = $candidate -}}
{{- end -}}
{{- end -}}
{{- range $patterns -}}
{{- if and (not $found) (regexMatch "^[a-zA-Z0-9_-]+(\\.[a-zA-Z0-9_-]+)*$" .) -}}
{{- $found = . -}}
{{- end -}}
{{- end -}}
{{- $found -}}
{{- end -}}
