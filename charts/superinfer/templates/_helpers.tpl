{{/* Names: <release>-superinfer unless the release name already holds the chart name. */}}
{{- define "superinfer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "superinfer.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "superinfer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels of one component: include with (dict "ctx" $ "component" "gateway"). */}}
{{- define "superinfer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "superinfer.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "superinfer.labels" -}}
helm.sh/chart: {{ include "superinfer.chart" .ctx }}
{{ include "superinfer.selectorLabels" . }}
app.kubernetes.io/part-of: superinfer
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end }}

{{- define "superinfer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "superinfer.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "superinfer.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "superinfer.adminTokenSecretName" -}}
{{- default (printf "%s-admin-token" (include "superinfer.fullname" .)) .Values.adminToken.existingSecret }}
{{- end }}

{{- define "superinfer.configMapName" -}}
{{- printf "%s-config" (include "superinfer.fullname" .) }}
{{- end }}

{{/* The Secret holding the Redis password: redis.auth.existingSecret, else the chart's own for
the bundled Redis (redis.auth.enabled), else none (an external Redis without a password). */}}
{{- define "superinfer.redisSecretName" -}}
{{- if .Values.redis.auth.existingSecret }}
{{- .Values.redis.auth.existingSecret }}
{{- else if and .Values.redis.bundled .Values.redis.auth.enabled }}
{{- printf "%s-redis" (include "superinfer.fullname" .) }}
{{- end }}
{{- end }}

{{/* The Redis URL the services get; with a password, Kubernetes expands $(REDIS_PASSWORD)
from the env var that superinfer.redisEnv puts before it. */}}
{{- define "superinfer.redisUrl" -}}
{{- $url := "" }}
{{- if .Values.redis.bundled }}
{{- $url = printf "redis://%s-redis:6379/0" (include "superinfer.fullname" .) }}
{{- else }}
{{- $url = required "redis.url is required when redis.bundled is false" .Values.redis.url }}
{{- if not (regexMatch "^rediss?://" $url) }}
{{- fail "redis.url must start with redis:// or rediss://" }}
{{- end }}
{{- end }}
{{- if include "superinfer.redisSecretName" . }}
{{- $url = regexReplaceAll "^(rediss?://)" $url "${1}:$$(REDIS_PASSWORD)@" }}
{{- end }}
{{- $url }}
{{- end }}

{{- define "superinfer.redisEnv" -}}
{{- with include "superinfer.redisSecretName" . -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.redis.auth.secretKey }}
{{ end -}}
- name: SUPERINFER_REDIS_URL
  value: {{ include "superinfer.redisUrl" . | quote }}
{{- end }}

{{/* Pod-level settings shared by the SuperInfer pods. */}}
{{- define "superinfer.podSpecCommon" -}}
serviceAccountName: {{ include "superinfer.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{- define "superinfer.scrapeAnnotations" -}}
{{- if .ctx.Values.metrics.podAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/* The model volume (nothing when model.source is none). */}}
{{- define "superinfer.modelVolume" -}}
{{- if eq .Values.model.source "pvc" -}}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required" .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "hostPath" -}}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required" .Values.model.hostPath.path }}
    type: Directory
{{- else if ne .Values.model.source "none" }}
{{- fail "model.source must be pvc, hostPath or none" }}
{{- end }}
{{- end }}

{{- define "superinfer.modelMount" -}}
{{- if ne .Values.model.source "none" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
  {{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end }}

{{- define "superinfer.modelEnv" -}}
- name: SUPERINFER_MODEL
  value: {{ required "model.path is required" .Values.model.path | quote }}
{{- with .Values.model.tokenizer }}
- name: SUPERINFER_TOKENIZER
  value: {{ . | quote }}
{{- end }}
{{- end }}

{{/* Host memory of a worker, in GiB: the DRAM KV pool plus the process's own. */}}
{{- define "superinfer.dataPlaneMemoryRequestGiB" -}}
{{- add (ceil .Values.dataPlane.dramKvGiB | int) (ceil .Values.dataPlane.hostMemoryOverheadGiB | int) }}
{{- end }}

{{- define "superinfer.dataPlaneMemoryLimitGiB" -}}
{{- $request := include "superinfer.dataPlaneMemoryRequestGiB" . | int }}
{{- add $request (ceil .Values.dataPlane.shmSizeGiB | int) (ceil .Values.dataPlane.memoryLimitHeadroomGiB | int) }}
{{- end }}

