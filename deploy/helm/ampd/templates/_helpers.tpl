{{/* Names and labels, as `helm create` makes them. */}}
{{- define "ampd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ampd.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "ampd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ampd.labels" -}}
helm.sh/chart: {{ include "ampd.chart" . }}
{{ include "ampd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "ampd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ampd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* ampd's own image (Dockerfile). */}}
{{- define "ampd.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString .Values.image.tag) }}
{{- end }}

{{/* The Redis every process registers in and coordinates through. */}}
{{- define "ampd.redisEnv" -}}
{{- if .Values.redis.enabled -}}
- name: REDIS_URL
  value: {{ printf "redis://%s-redis:6379/0" (include "ampd.fullname" .) | quote }}
{{- else if .Values.redis.existingSecret -}}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.existingSecretKey }}
{{- else -}}
- name: REDIS_URL
  value: {{ required "redis.enabled is false: set redis.url or redis.existingSecret" .Values.redis.url | quote }}
{{- end }}
{{- end }}

{{/* Prometheus' conventional annotations for the pods that serve /metrics on 8000. */}}
{{- define "ampd.scrapeAnnotations" -}}
{{- if .Values.monitoring.podAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: "8000"
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/* Pods running ampd's image: its user (Dockerfile: useradd ampd, uid 1000), no privileges. */}}
{{- define "ampd.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "ampd.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets -}}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
