{{/* Names and labels shared by every object of the chart. */}}

{{- define "kinference.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kinference.fullname" -}}
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

{{- define "kinference.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kinference.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kinference.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kinference.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: router
app.kubernetes.io/part-of: kinference
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kinference.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kinference.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The namespace holding the InferencePool and its pods: where the router needs its Role. */}}
{{- define "kinference.poolNamespace" -}}
{{- default .Release.Namespace .Values.inferencePool.namespace }}
{{- end }}

{{- define "kinference.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* "true" in epp mode (`kinference epp`), "" in serve mode; any other mode fails. */}}
{{- define "kinference.epp" -}}
{{- if eq .Values.mode "epp" }}true
{{- else if ne .Values.mode "serve" }}
{{- fail (printf "mode must be serve or epp, not %q" .Values.mode) }}
{{- end }}
{{- end }}

{{/* The container's arguments: the subcommand and its listen address (the OpenAI port in serve
mode, the gRPC port in epp mode), the admin address, then either the config file or the one
pool, then the picker's own flags in epp mode. */}}
{{- define "kinference.args" -}}
{{- if include "kinference.epp" . -}}
- epp
- {{ print "--listen=0.0.0.0:" .Values.ports.epp | quote }}
{{- else -}}
- serve
- {{ print "--listen=0.0.0.0:" .Values.ports.http | quote }}
{{- end }}
- {{ print "--admin=0.0.0.0:" .Values.ports.admin | quote }}
{{- if .Values.config }}
- --config=/etc/kinference/config.yaml
{{- else }}
- {{ print "--namespace=" (include "kinference.poolNamespace" .) | quote }}
- {{ print "--inference-pool=" (required "inferencePool.name is required (or a whole `config`)" .Values.inferencePool.name) | quote }}
{{- if not .Values.pool.models }}
{{- fail "pool.models is required (or a whole `config`)" }}
{{- end }}
- {{ print "--model=" (join "," .Values.pool.models) | quote }}
- {{ print "--tokenizer=" .Values.pool.tokenizerPath | quote }}
{{- if not .Values.pool.blockSize }}
{{- fail "pool.blockSize is required (vLLM's --block-size), or a whole `config`" }}
{{- end }}
- {{ print "--block-size=" .Values.pool.blockSize | quote }}
- {{ print "--hash-algo=" .Values.pool.hashAlgo | quote }}
{{- if .Values.pool.hashSeed }}
- {{ print "--hash-seed=" .Values.pool.hashSeed | quote }}
{{- else if hasPrefix "xxhash" .Values.pool.hashAlgo }}
{{- fail "pool.hashSeed is required with an xxhash algorithm: vLLM draws a random seed unless PYTHONHASHSEED is set" }}
{{- end }}
{{- with .Values.pool.policy }}
- {{ print "--policy=" . | quote }}
{{- end }}
{{- if .Values.scaleIn.podDeletionCost }}
{{- $s := .Values.scaleIn }}
- {{ print "--scale-in=" (dict "pod_deletion_cost" true "half_life_s" $s.halfLifeSeconds "interval_s" $s.intervalSeconds "hysteresis" $s.hysteresis "max_patches" $s.maxPatches | toJson) | quote }}
{{- end }}
{{- end }}
{{- if include "kinference.epp" . }}
- {{ print "--request-body-mode=" .Values.epp.requestBodyMode | quote }}
- {{ print "--response-body-mode=" .Values.epp.responseBodyMode | quote }}
- {{ print "--keepalive-s=" .Values.epp.keepaliveSeconds | quote }}
{{- end }}
{{- with .Values.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The created InferencePool's name; it lives in the release namespace. */}}
{{- define "kinference.inferencePoolName" -}}
{{- required "inferencePool.name is required with inferencePool.create" .Values.inferencePool.name }}
{{- end }}
