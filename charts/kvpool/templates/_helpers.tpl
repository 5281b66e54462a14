{{/*
Names and labels of every object of the chart.
*/}}

{{/* The chart name, "kvpool" unless nameOverride says otherwise. */}}
{{- define "kvpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The prefix of object names: "<release>-kvpool", or the release name if it contains the chart name. */}}
{{- define "kvpool.fullname" -}}
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

{{/* "<chart>-<version>" for the helm.sh/chart label. */}}
{{- define "kvpool.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels that select the operator pod; never change them on upgrade. */}}
{{- define "kvpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels of every object. */}}
{{- define "kvpool.labels" -}}
helm.sh/chart: {{ include "kvpool.chart" . }}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvpool
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The operator's ServiceAccount name. */}}
{{- define "kvpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvpool.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The kvpool image reference: repository@digest, or repository:tag (default appVersion). */}}
{{- define "kvpool.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The images pools may name (operatorPolicy.allowedImages), space-separated; default: the
repository of the agent image (operator.agentImage or the chart's image), without its tag
or digest. */}}
{{- define "kvpool.allowedImages" -}}
{{- if .Values.operatorPolicy.allowedImages -}}
{{- join " " .Values.operatorPolicy.allowedImages -}}
{{- else -}}
{{- $agent := default (include "kvpool.image" .) .Values.operator.agentImage -}}
{{- regexReplaceAll "(@.*|:[^:/]*)$" $agent "" -}}
{{- end -}}
{{- end -}}

{{/* Names of the webhook's Service, TLS Secret and configuration. */}}
{{- define "kvpool.webhookServiceName" -}}
{{- printf "%s-webhook" (include "kvpool.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- define "kvpool.webhookSecretName" -}}
{{- printf "%s-webhook-tls" (include "kvpool.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Name of the operator metrics Service. */}}
{{- define "kvpool.metricsServiceName" -}}
{{- printf "%s-metrics" (include "kvpool.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
