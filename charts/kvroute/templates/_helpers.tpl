{{- define "kvroute.labels" -}}
app.kubernetes.io/name: kvroute
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{- /* The replica store: the one this release deploys, or the one the values name. */}}
{{- define "kvroute.replicaStoreURL" -}}
{{- $store := .Values.extproc.replicaStore -}}
{{- if $store.deploy -}}
redis://{{ .Release.Name }}-replica-store.{{ .Release.Namespace }}.svc.cluster.local:6379/0
{{- else if $store.url -}}
{{ $store.url }}
{{- else -}}
{{ fail "extproc.replicas > 1 needs extproc.replicaStore.deploy or extproc.replicaStore.url" }}
{{- end -}}
{{- end }}

{{- define "kvroute.replicaStoreSecret" -}}
{{- if .Values.extproc.replicaStore.deploy -}}
{{ .Release.Name }}-replica-store
{{- else -}}
{{ required "extproc.replicaStore.passwordSecret: a Secret with key `password`" .Values.extproc.replicaStore.passwordSecret }}
{{- end -}}
{{- end }}
