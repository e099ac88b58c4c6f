{{/* The release's name for its objects: the release name when it names the chart. */}}
{{- define "esi-sidecar.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "esi-sidecar.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "esi-sidecar.labels" -}}
{{ include "esi-sidecar.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- /* With upload on and no tag given, the Dockerfile's UPLOAD=1 variant's tag. */}}
{{- define "esi-sidecar.image" -}}
{{- $default := ternary (printf "%s-upload" .Chart.AppVersion) .Chart.AppVersion (ne .Values.upload.to "") -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default $default) -}}
{{- end -}}

{{- /* upload.to's folder for a file:// destination ("" for s3://), where toVolume goes. */}}
{{- define "esi-sidecar.uploadVolumePath" -}}
{{- if hasPrefix "file://" .Values.upload.to -}}
{{- (urlParse .Values.upload.to).path -}}
{{- end -}}
{{- end -}}

{{- define "esi-sidecar.tokenSecret" -}}
{{- .Values.token.existingSecret | default (printf "%s-token" (include "esi-sidecar.fullname" .)) -}}
{{- end -}}

{{- define "esi-sidecar.credentialsSecret" -}}
{{- .Values.credentials.existingSecret | default (printf "%s-credentials" (include "esi-sidecar.fullname" .)) -}}
{{- end -}}
