{{- define "kvroute.labels" -}}
app.kubernetes.io/name: kvroute
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
